"""The custom VJPs of revnet's loops: forward loop, backward reversed loop.

:func:`scan_function` and :func:`while_function` build the ``jax.custom_vjp``
functions behind ``revnet.scan`` and ``revnet.while_loop``, in the three modes
of :mod:`.modes`:

* **invert**: the forward pass saves only the final carry (and ``xs``, ``ys``,
  the trip count, the constants); the backward pass walks back step by step,
  rebuilding each carry from the next by the body's plan, fused with the
  body's VJP.
* **store**: as *invert*, and the forward pass also stores, at every step, the
  carry leaves the plan cannot rebuild; the backward pass reads them.
* **checkpoint**: the forward pass saves the initial carry and the trip count;
  the backward pass recomputes carries from snapshots by the binomial
  schedule of :mod:`.revolve` and takes the body's VJP at each step.

The backward pass runs only the steps the forward pass took. The backward
functions are tagged, so that the analysis recognises a loop inside an
``@invertible`` function. The jitted forward loops are cached by what they
compute (the body's jaxpr by structure), so an eager loop called again with
the same body reuses JAX's compiled forward loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from revnet._engine import anchors as anc
from revnet._engine import checks, cotangents, fingerprint, revolve
from revnet._engine.analysis import LRU
from revnet._engine.calls import LoopTag
from revnet._engine.interpreter import evaluate, run_plan
from revnet._engine.jaxpr import Body, ScanParams, aval, eval_body, tag
from revnet._engine.modes import CHECKPOINT, Mode
from revnet._engine.scan import merge, reversed_scan

# The jitted forward loops of recent calls, keyed by what they compute (the
# body's structure and its nested constants by identity; derivative rules do
# not change a forward value): an eager loop called again reuses its compiled
# forward loop. The custom VJP around it is made per call: its backward takes
# the rules of the current trace.
_FORWARDS = LRU(64)


def _avals(vars_: Any) -> list[Any]:
    return [aval(v) for v in vars_]


def scan_function(
    sp: ScanParams,
    mode: Mode,
    slots: int,
    anchor_every: int | None = None,
    report: Any = None,
):
    """``run(consts, init, xs) -> (final, ys)``, a custom VJP for the scan ``sp``.

    Args:
      sp: the scan; its body's inputs are the constants, carry and ``xs``.
      mode: how the backward pass gets each carry (:mod:`.modes`).
      slots: the number of snapshots when checkpointing.
      anchor_every: when inverting, store the carry every ``anchor_every``
        steps and continue the backward pass from it (:mod:`.anchors`).
        Checkpointing recomputes carries exactly and uses no anchors.
      report: with anchors, None or a function given the drift at each
        anchor (through ``jax.debug.callback``) by every backward pass.
    """
    forward = _cached_scan_forward(sp, mode.stored, None)
    if mode.kind == CHECKPOINT:
        return _checkpointed_scan(sp, forward, slots)
    # The primal function has no anchors: it is what an enclosing
    # ``@invertible`` sees (and inverts), and what a call without a VJP runs.
    anchored = forward
    if anchor_every is not None and sp.length > 0:
        anchored = _cached_scan_forward(sp, mode.stored, anchor_every)
    else:
        anchor_every = None  # nothing to anchor in a loop of no steps
    return _make_scan(sp, mode, forward, anchored, anchor_every, report)


def _cached_scan_forward(sp: ScanParams, stored, every: int | None):
    key = (
        "scan",
        fingerprint.primal(sp.body.jaxpr),
        sp.num_consts,
        sp.num_carry,
        sp.length,
        sp.reverse,
        repr(sp.unroll),
        stored,
        every,
    )
    forward = _FORWARDS.get(key)
    if forward is None:
        forward = _scan_forward(sp, stored, every)
        _FORWARDS.put(key, forward)
    return forward


def while_function(
    body_jaxpr,
    cond_jaxpr,
    mode: Mode,
    nk: int,
    bound: int | None,
    slots: int,
    step_hooks: Sequence[Any] = (),
    anchor_every: int | None = None,
    report: Any = None,
):
    """``run(body_consts, cond_consts, carry) -> carry``, a custom VJP while loop.

    Args:
      body_jaxpr, cond_jaxpr: the body and condition, constants first.
      mode: how the backward pass gets each carry (:mod:`.modes`).
      nk: the number of the body's constants.
      bound: the largest number of steps, or None.
      slots: the number of snapshots when checkpointing.
      step_hooks: callbacks given the remaining-step counter of every backward
        iteration at run time (a testing aid; read when the backward is traced).
      anchor_every: as in :func:`scan_function`; room is made for the anchors
        of ``bound`` steps (of one step without a bound: the initial carry).
      report: as in :func:`scan_function`.
    """
    forward = _cached_while_forward(body_jaxpr, cond_jaxpr, bound, mode.stored, None)
    if mode.kind == CHECKPOINT:
        return _checkpointed_while(body_jaxpr, cond_jaxpr, nk, forward, slots)
    anchored = forward  # as in scan_function: the primal function has none
    if anchor_every is not None and bound != 0:
        anchored = _cached_while_forward(
            body_jaxpr, cond_jaxpr, bound, mode.stored, anchor_every
        )
    else:
        anchor_every = None
    return _make_while(
        body_jaxpr,
        cond_jaxpr,
        mode,
        nk,
        (forward, anchored),
        step_hooks,
        anchor_every,
        report,
    )


def _cached_while_forward(body_jaxpr, cond_jaxpr, bound, stored, every):
    key = (
        "while_loop",
        fingerprint.primal(body_jaxpr),
        fingerprint.primal(cond_jaxpr),
        bound,
        stored,
        every,
    )
    forward = _FORWARDS.get(key)
    if forward is None:
        forward = _while_forward(
            Body(body_jaxpr, ()), Body(cond_jaxpr, ()), bound, stored, every
        )
        _FORWARDS.put(key, forward)
    return forward


def _kept(carry: Sequence[Any], stored: Sequence[bool]) -> list:
    return [x for x, s in zip(carry, stored) if s]


def _while_forward(
    body: Body, cond: Body, bound: int | None, stored, every: int | None
):
    """``forward(bk, ck, carry) -> (steps, final, stored leaves, anchors)``,
    jitted; ``anchors`` is empty unless ``every`` is given."""

    def forward(bk, ck, carry):
        def go(state):
            n, c, _, _ = state
            p = eval_body(cond, *ck, *c)[0]
            return p if bound is None else jnp.logical_and(p, n < bound)

        def step(state):
            n, c, bufs, kept = state
            bufs = [
                lax.dynamic_update_index_in_dim(b, x, n, 0)
                for b, x in zip(bufs, _kept(c, stored))
            ]
            if every is not None:
                kept = anc.keep(kept, c, n, every)
            return n + 1, eval_body(body, *bk, *c), bufs, kept

        bufs = [
            jnp.zeros((bound, *jnp.shape(x)), x.dtype) for x in _kept(carry, stored)
        ]
        kept = []
        if every is not None:
            kept = anc.empty(carry, 1 if bound is None else anc.count(bound, every))
        state = (jnp.zeros((), jnp.int32), list(carry), bufs, kept)
        return lax.while_loop(go, step, state)

    return jax.jit(forward)


def _scan_forward(sp: ScanParams, stored, every: int | None):
    """``forward(consts, init, xs) -> (final, (ys, stored leaves), anchors)``,
    jitted; ``anchors`` is empty unless ``every`` is given."""
    nc = sp.num_carry

    def forward(consts, init, xs):
        def body(state, x):
            c, bufs, i = state
            out = eval_body(sp.body, *consts, *c, *x)
            if every is not None:
                bufs, i = anc.keep(bufs, c, i, every), i + 1
            return (out[:nc], bufs, i), (out[nc:], _kept(c, stored))

        bufs, i = [], None
        if every is not None:
            bufs = anc.empty(init, anc.count(sp.length, every))
            i = jnp.int32(0)
        (final, bufs, _), out = lax.scan(
            body,
            (list(init), bufs, i),
            list(xs),
            length=sp.length,
            reverse=sp.reverse,
            unroll=sp.unroll,
        )
        return final, out, bufs

    return jax.jit(forward)


def _make_while(
    body_jaxpr,
    cond_jaxpr,
    mode: Mode,
    nk: int,
    forwards,
    step_hooks,
    every: int | None,
    report,
):
    """The custom-VJP function ``run(body_consts, cond_consts, carry) -> carry``.

    ``forwards``: the primal forward loop, and the one a differentiated call
    runs, which also stores anchors every ``every`` steps.
    """
    forward, anchored = forwards
    k_avals = _avals(body_jaxpr.invars[:nk])
    c_avals = _avals(body_jaxpr.invars[nk:])
    q_avals = _avals(cond_jaxpr.invars[: len(cond_jaxpr.invars) - len(c_avals)])
    plan, stored = mode.plan, mode.stored

    @jax.custom_vjp
    def run(bk, ck, carry):
        return forward(bk, ck, carry)[1]

    def fwd(bk, ck, carry):
        n, final, bufs, kept = anchored(bk, ck, carry)
        return final, (bk, final, n, bufs, kept)

    def bwd(res, cts):
        bk, final, n, bufs, kept = res
        anchors = None if every is None else anc.Anchors(every, kept, report)
        hooks = tuple(step_hooks)

        def go(state):
            return state[0] > 0

        messages: list[str] = []

        def step(state):
            m, c, ctc, ctk, bad, drift = state
            for hook in hooks:
                jax.debug.callback(hook, m)
            kept = [lax.dynamic_index_in_dim(b, m - 1, keepdims=False) for b in bufs]
            with checks.scope() as sc:
                prev, in_cts = run_plan(
                    plan, body_jaxpr, list(bk) + kept, list(c), list(ctc)
                )
            bad = checks.merge(bad, sc, messages)
            in_cts = cotangents.float_or_none(in_cts, k_avals + c_avals)
            ctk = cotangents.add_into(ctk, in_cts[:nk])
            prev = merge(prev, kept, stored)
            if anchors is not None:
                prev, drift = anc.restore(anchors, prev, m - 1, drift)
            return m - 1, prev, in_cts[nk:], ctk, bad, drift

        state = (
            n,
            list(final),
            cotangents.float_or_none(list(cts), c_avals),
            cotangents.float_or_none([None] * nk, k_avals),
            jnp.int32(-1) if checks.enabled() else None,
            None if anchors is None else anc.start(anchors, anc.slots(anchors)),
        )
        with checks.scope() as top:
            _, _, ct_init, ct_k, bad, drift = lax.while_loop(go, step, state)
            checks.record_index(bad, messages)
        checks.raise_if_failed(top)
        if anchors is not None:
            anc.report(anchors, drift, jnp.where(n > 0, (n - 1) // every + 1, 0))
        return (
            cotangents.fill(ct_k, k_avals),
            [cotangents.zeros(a) for a in q_avals],
            cotangents.fill(ct_init, c_avals),
        )

    tag(bwd, LoopTag("while_loop"))  # recognised by the analysis
    run.defvjp(fwd, bwd)
    return run


def _checkpointed_while(body_jaxpr, cond_jaxpr, nk: int, forward, slots: int):
    """As :func:`_make_while`, with a backward pass that recomputes carries."""
    k_avals = _avals(body_jaxpr.invars[:nk])
    c_avals = _avals(body_jaxpr.invars[nk:])
    q_avals = _avals(cond_jaxpr.invars[: len(cond_jaxpr.invars) - len(c_avals)])

    @jax.custom_vjp
    def run(bk, ck, carry):
        return forward(bk, ck, carry)[1]

    def fwd(bk, ck, carry):
        n, final, _, _ = forward(bk, ck, carry)
        return final, (bk, list(carry), n)

    def bwd(res, cts):
        bk, init, n = res

        def step(*args):
            return evaluate(body_jaxpr, args)

        def advance(t, c):
            return step(*bk, *c)

        def vjp_step(t, c, state):
            ctc, ctk = state
            in_cts = cotangents.vjp(step, [*bk, *c], c_avals, ctc)
            in_cts = cotangents.float_or_none(in_cts, k_avals + c_avals)
            return in_cts[nk:], cotangents.add_into(ctk, in_cts[:nk])

        state = (
            cotangents.float_or_none(list(cts), c_avals),
            cotangents.float_or_none([None] * nk, k_avals),
        )
        ct_init, ct_k = revolve.reverse(advance, vjp_step, init, n, slots, state)
        return (
            cotangents.fill(ct_k, k_avals),
            [cotangents.zeros(a) for a in q_avals],
            cotangents.fill(ct_init, c_avals),
        )

    tag(bwd, LoopTag("while_loop"))
    run.defvjp(fwd, bwd)
    return run


def _scan_avals(sp: ScanParams):
    nk, nc = sp.num_consts, sp.num_carry
    invars = sp.body.jaxpr.invars
    k_avals = _avals(invars[:nk])
    c_avals = _avals(invars[nk : nk + nc])
    x_avals = [a.update(shape=(sp.length, *a.shape)) for a in _avals(invars[nk + nc :])]
    return k_avals, c_avals, x_avals


def _make_scan(
    sp: ScanParams, mode: Mode, forward, anchored, every: int | None, report
):
    """The custom-VJP function ``run(consts, init, xs) -> (final, ys)``.

    ``forward`` runs the primal function; ``anchored`` the forward pass of a
    differentiated call, which also stores anchors every ``every`` steps.
    """
    nk, nc = sp.num_consts, sp.num_carry
    k_avals, c_avals, x_avals = _scan_avals(sp)
    known_xs = (True,) * len(x_avals)
    known_ys = (True,) * (len(sp.body.jaxpr.outvars) - nc)
    stored = mode.stored

    @jax.custom_vjp
    def run(consts, init, xs):
        final, (ys, _), _ = forward(consts, init, xs)
        return final, ys

    def fwd(consts, init, xs):
        final, (ys, bufs), kept = anchored(consts, init, xs)
        return (final, ys), (consts, xs, final, ys, bufs, kept)

    def bwd(res, cts):
        consts, xs, final, ys, bufs, kept = res
        anchors = None if every is None else anc.Anchors(every, kept, report)
        ct_final, ct_ys = cts
        known = list(consts) + [None] * nc + list(xs)
        outs = list(final) + list(ys)
        with checks.scope() as top:
            _, in_cts = reversed_scan(
                sp,
                mode.plan,
                known_xs,
                known_ys,
                known,
                outs,
                list(ct_final) + list(ct_ys),
                merge([None] * (nc - len(bufs)), bufs, stored),
                anchors,
            )
        checks.raise_if_failed(top)
        in_cts = cotangents.fill(in_cts, k_avals + c_avals + x_avals)
        return in_cts[:nk], in_cts[nk : nk + nc], in_cts[nk + nc :]

    tag(bwd, LoopTag("scan"))  # recognised by the analysis
    run.defvjp(fwd, bwd)
    return run


def _checkpointed_scan(sp: ScanParams, forward, slots: int):
    """As :func:`_make_scan`, with a backward pass that recomputes carries."""
    nk, nc, n = sp.num_consts, sp.num_carry, sp.length
    k_avals, c_avals, x_avals = _scan_avals(sp)
    out_avals = _avals(sp.body.jaxpr.outvars)

    @jax.custom_vjp
    def run(consts, init, xs):
        final, (ys, _), _ = forward(consts, init, xs)
        return final, ys

    def fwd(consts, init, xs):
        final, (ys, _), _ = forward(consts, init, xs)
        return (final, ys), (consts, list(init), xs)

    def bwd(res, cts):
        consts, init, xs = res
        ct_final, ct_ys = cts
        ct_ys = cotangents.drop_float0(ct_ys)

        def at(t):
            return n - 1 - t if sp.reverse else t

        def row(stack, t):
            return [lax.dynamic_index_in_dim(a, at(t), keepdims=False) for a in stack]

        def step(*args):
            return evaluate(sp.body.jaxpr, args)

        def advance(t, c):
            return step(*consts, *c, *row(xs, t))[:nc]

        def vjp_step(t, c, state):
            ctc, ctk, ctx = state
            cty = [None if a is None else row([a], t)[0] for a in ct_ys]
            in_cts = cotangents.vjp(
                step, [*consts, *c, *row(xs, t)], out_avals, [*ctc, *cty]
            )
            in_cts = cotangents.float_or_none(in_cts, k_avals + c_avals + x_avals_t)
            ctx = [
                a if a is None else lax.dynamic_update_index_in_dim(a, g, at(t), 0)
                for a, g in zip(ctx, in_cts[nk + nc :])
            ]
            return in_cts[nk : nk + nc], cotangents.add_into(ctk, in_cts[:nk]), ctx

        x_avals_t = _avals(sp.body.jaxpr.invars[nk + nc :])
        state = (
            cotangents.float_or_none(list(ct_final), c_avals),
            cotangents.float_or_none([None] * nk, k_avals),
            cotangents.float_or_none([None] * len(x_avals), x_avals),
        )
        ct_init, ct_k, ct_xs = revolve.reverse(advance, vjp_step, init, n, slots, state)
        in_cts = cotangents.fill([*ct_k, *ct_init, *ct_xs], k_avals + c_avals + x_avals)
        return in_cts[:nk], in_cts[nk : nk + nc], in_cts[nk + nc :]

    tag(bwd, LoopTag("scan"))
    run.defvjp(fwd, bwd)
    return run
