"""The custom VJPs of revnet's loops: forward loop, backward reversed loop.

:func:`while_function` here and :func:`~.scan_loop.scan_function` build the
``jax.custom_vjp`` functions behind ``revnet.while_loop`` and ``revnet.scan``,
in the three modes of :mod:`.modes`:

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
the same body reuses JAX's compiled forward loop; this module holds that
cache (:func:`forwards`) for both loops.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from revnet._engine import anchors as anc
from revnet._engine import checks, cotangents, fingerprint, revolve
from revnet._engine import perturbed as pb
from revnet._engine.analysis import LRU
from revnet._engine.calls import LoopTag
from revnet._engine.interpreter import evaluate, run_plan
from revnet._engine.jaxpr import Body, aval, eval_body, tag
from revnet._engine.modes import CHECKPOINT, Mode
from revnet._engine.scan import merge

# The jitted forward loops of recent calls, keyed by what they compute (the
# body's structure and its nested constants by identity; derivative rules do
# not change a forward value): an eager loop called again reuses its compiled
# forward loop. The custom VJP around it is made per call: its backward takes
# the rules of the current trace.
_FORWARDS = LRU(64)


def avals(vars_: Any) -> list[Any]:
    """The abstract values of jaxpr variables."""
    return [aval(v) for v in vars_]


def stored_leaves(carry: Sequence[Any], stored: Sequence[bool]) -> list:
    """The carry leaves that are stored at every step."""
    return [x for x, s in zip(carry, stored) if s]


def forwards(
    key: tuple, make: Callable[[int | None], Any], anchor_every: int | None, steps
) -> tuple[Any, Any, int | None]:
    """The jitted forward loops of one loop, cached by ``key``.

    Args:
      key: what the loop computes (anchors aside).
      make: builds the forward loop, given the anchor spacing or None.
      anchor_every: the anchor spacing asked for, or None.
      steps: the most steps the loop can take (None: no bound).

    Returns:
      ``(primal, differentiated, anchor_every)``: the primal forward loop has
      no anchors (it is what an enclosing ``@invertible`` sees and inverts,
      and what a call without a VJP runs); the one a differentiated call runs
      stores anchors, unless none were asked for or the loop takes no step
      (then ``anchor_every`` is None and both are the same).
    """

    def cached(every):
        forward = _FORWARDS.get((*key, every))
        if forward is None:
            forward = make(every)
            _FORWARDS.put((*key, every), forward)
        return forward

    primal = cached(None)
    if anchor_every is None or steps == 0:
        return primal, primal, None
    return primal, cached(anchor_every), anchor_every


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
      anchor_every: as in :func:`~.scan_loop.scan_function`; room is made for
        the anchors of ``bound`` steps (of one step without a bound: the
        initial carry).
      report: as in :func:`~.scan_loop.scan_function`.
    """
    key = (
        "while_loop",
        fingerprint.primal(body_jaxpr),
        fingerprint.primal(cond_jaxpr),
        bound,
        mode.stored,
    )
    body, cond = Body(body_jaxpr, ()), Body(cond_jaxpr, ())

    def make(every):
        return _while_forward(body, cond, bound, mode.stored, every)

    if mode.kind == CHECKPOINT:
        forward, _, _ = forwards(key, make, None, bound)
        return _checkpointed_while(body_jaxpr, cond_jaxpr, nk, forward, slots)
    forward, anchored, anchor_every = forwards(key, make, anchor_every, bound)
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
            n, c, bufs, marks = state
            bufs = [
                lax.dynamic_update_index_in_dim(b, x, n, 0)
                for b, x in zip(bufs, stored_leaves(c, stored))
            ]
            if every is not None:
                marks = anc.keep(marks, c, n, every)
            return n + 1, eval_body(body, *bk, *c), bufs, marks

        # At least one row: a loop bounded by 0 steps writes none, but its
        # (never run) step must still trace.
        bufs = [
            jnp.zeros((max(bound, 1), *jnp.shape(x)), x.dtype)
            for x in stored_leaves(carry, stored)
        ]
        marks = []
        if every is not None:
            marks = anc.empty(carry, 1 if bound is None else anc.count(bound, every))
        state = (jnp.zeros((), jnp.int32), list(carry), bufs, marks)
        return lax.while_loop(go, step, state)

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
    k_avals = avals(body_jaxpr.invars[:nk])
    c_avals = avals(body_jaxpr.invars[nk:])
    q_avals = avals(cond_jaxpr.invars[: len(cond_jaxpr.invars) - len(c_avals)])
    plan, stored = mode.plan, mode.stored

    @jax.custom_vjp
    def run(bk, ck, carry):
        return forward(bk, ck, carry)[1]

    def fwd(bk, ck, carry):
        (bk, ck, carry), flags = pb.split_primals((bk, ck, carry))
        n, final, bufs, marks = anchored(bk, ck, carry)
        return final, (bk, final, n, bufs, marks, pb.Flags(flags))

    def bwd(res, cts):
        bk, final, n, bufs, marks, flags = res
        cts = pb.drop_symbolic_zeros(cts)
        perturbed = _body_perturbed(body_jaxpr, nk, flags.value)
        anchors = None if every is None else anc.Anchors(every, marks, report)
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
                    plan, body_jaxpr, list(bk) + kept, list(c), list(ctc), perturbed
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
    run.defvjp(fwd, bwd, symbolic_zeros=True)
    return run


def _body_perturbed(body_jaxpr, nk: int, flags) -> list[bool]:
    """Which inputs of a while loop's body are differentiated, given the flags
    of the loop's inputs (body constants, condition constants, carry)."""
    nc = len(body_jaxpr.invars) - nk
    p_k, p_c = list(flags[:nk]), flags[len(flags) - nc :]
    return p_k + pb.loop_carry(body_jaxpr, p_k, p_c, [])


def _checkpointed_while(body_jaxpr, cond_jaxpr, nk: int, forward, slots: int):
    """As :func:`_make_while`, with a backward pass that recomputes carries."""
    k_avals = avals(body_jaxpr.invars[:nk])
    c_avals = avals(body_jaxpr.invars[nk:])
    q_avals = avals(cond_jaxpr.invars[: len(cond_jaxpr.invars) - len(c_avals)])

    @jax.custom_vjp
    def run(bk, ck, carry):
        return forward(bk, ck, carry)[1]

    def fwd(bk, ck, carry):
        (bk, ck, carry), flags = pb.split_primals((bk, ck, carry))
        n, final, _, _ = forward(bk, ck, carry)
        return final, (bk, list(carry), n, pb.Flags(flags))

    def bwd(res, cts):
        bk, init, n, flags = res
        cts = pb.drop_symbolic_zeros(cts)
        perturbed = _body_perturbed(body_jaxpr, nk, flags.value)

        def step(*args):
            return evaluate(body_jaxpr, args)

        def advance(t, c):
            return step(*bk, *c)

        def vjp_step(t, c, state):
            ctc, ctk = state
            in_cts = cotangents.vjp(step, [*bk, *c], c_avals, ctc, perturbed)
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
    run.defvjp(fwd, bwd, symbolic_zeros=True)
    return run
