"""The custom VJP of ``revnet.scan``: forward scan, backward reversed scan.

:func:`scan_function` builds it in the three modes of :mod:`.modes`, as
:mod:`.loops` describes for both loops: inverting and storing walk back with
:func:`~.scan.reversed_scan` (from anchors, when asked for), checkpointing
recomputes carries by :mod:`.revolve`. The jitted forward scans are cached by
:func:`.loops.forwards`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from revnet._engine import anchors as anc
from revnet._engine import checks, cotangents, fingerprint, revolve
from revnet._engine import perturbed as pb
from revnet._engine.calls import LoopTag
from revnet._engine.interpreter import evaluate
from revnet._engine.jaxpr import ScanParams, eval_body, tag
from revnet._engine.jaxpr import scan as plain_scan
from revnet._engine.loops import avals, forwards, stored_leaves
from revnet._engine.modes import CHECKPOINT, Mode
from revnet._engine.scan import merge, reversed_scan


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
    key = (
        "scan",
        fingerprint.primal(sp.body.jaxpr),
        sp.num_consts,
        sp.num_carry,
        sp.length,
        sp.reverse,
        repr(sp.unroll),
        mode.stored,
    )

    def make(every):
        return _scan_forward(sp, mode.stored, every)

    if mode.kind == CHECKPOINT:
        forward, _, _ = forwards(key, make, None, sp.length)
        return _checkpointed_scan(sp, forward, slots)
    forward, anchored, anchor_every = forwards(key, make, anchor_every, sp.length)
    return _make_scan(sp, mode, forward, anchored, anchor_every, report)


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
            return (out[:nc], bufs, i), (out[nc:], stored_leaves(c, stored))

        bufs, i = [], None
        if every is not None:
            bufs = anc.empty(init, anc.count(sp.length, every))
            i = jnp.int32(0)
        (final, bufs, _), out = plain_scan(
            body,
            (list(init), bufs, i),
            list(xs),
            length=sp.length,
            reverse=sp.reverse,
            unroll=sp.unroll,
        )
        return final, out, bufs

    return jax.jit(forward)


def _scanavals(sp: ScanParams):
    nk, nc = sp.num_consts, sp.num_carry
    invars = sp.body.jaxpr.invars
    k_avals = avals(invars[:nk])
    c_avals = avals(invars[nk : nk + nc])
    x_avals = [a.update(shape=(sp.length, *a.shape)) for a in avals(invars[nk + nc :])]
    return k_avals, c_avals, x_avals


def _make_scan(
    sp: ScanParams, mode: Mode, forward, anchored, every: int | None, report
):
    """The custom-VJP function ``run(consts, init, xs) -> (final, ys)``.

    ``forward`` runs the primal function; ``anchored`` the forward pass of a
    differentiated call, which also stores anchors every ``every`` steps.
    """
    nk, nc = sp.num_consts, sp.num_carry
    k_avals, c_avals, x_avals = _scanavals(sp)
    known_xs = (True,) * len(x_avals)
    known_ys = (True,) * (len(sp.body.jaxpr.outvars) - nc)
    stored = mode.stored

    @jax.custom_vjp
    def run(consts, init, xs):
        final, (ys, _), _ = forward(consts, init, xs)
        return final, ys

    def fwd(consts, init, xs):
        (consts, init, xs), flags = pb.split_primals((consts, init, xs))
        final, (ys, bufs), marks = anchored(consts, init, xs)
        return (final, ys), (consts, xs, final, ys, bufs, marks, pb.Flags(flags))

    def bwd(res, cts):
        consts, xs, final, ys, bufs, marks, flags = res
        anchors = None if every is None else anc.Anchors(every, marks, report)
        ct_final, ct_ys = pb.drop_symbolic_zeros(cts)
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
                flags.value,
            )
        checks.raise_if_failed(top)
        in_cts = cotangents.fill(in_cts, k_avals + c_avals + x_avals)
        return in_cts[:nk], in_cts[nk : nk + nc], in_cts[nk + nc :]

    tag(bwd, LoopTag("scan"))  # recognised by the analysis
    run.defvjp(fwd, bwd, symbolic_zeros=True)
    return run


def _checkpointed_scan(sp: ScanParams, forward, slots: int):
    """As :func:`_make_scan`, with a backward pass that recomputes carries."""
    nk, nc, n = sp.num_consts, sp.num_carry, sp.length
    k_avals, c_avals, x_avals = _scanavals(sp)
    out_avals = avals(sp.body.jaxpr.outvars)

    @jax.custom_vjp
    def run(consts, init, xs):
        final, (ys, _), _ = forward(consts, init, xs)
        return final, ys

    def fwd(consts, init, xs):
        (consts, init, xs), flags = pb.split_primals((consts, init, xs))
        final, (ys, _), _ = forward(consts, init, xs)
        return (final, ys), (consts, list(init), xs, pb.Flags(flags))

    def bwd(res, cts):
        consts, init, xs, flags = res
        ct_final, ct_ys = pb.drop_symbolic_zeros(cts)
        if n == 0:  # no step: the carry passes through, nothing else is read
            in_cts = cotangents.fill(
                [None] * nk + list(ct_final) + [None] * len(x_avals),
                k_avals + c_avals + x_avals,
            )
            return in_cts[:nk], in_cts[nk : nk + nc], in_cts[nk + nc :]
        ct_ys = cotangents.drop_float0(ct_ys)

        def at(t):
            return n - 1 - t if sp.reverse else t

        def row(stack, t):
            return [lax.dynamic_index_in_dim(a, at(t), keepdims=False) for a in stack]

        def step(*args):
            return evaluate(sp.body.jaxpr, args)

        def advance(t, c):
            return step(*consts, *c, *row(xs, t))[:nc]

        p_k, p_x = list(flags.value[:nk]), list(flags.value[nk + nc :])
        p_c = pb.loop_carry(sp.body.jaxpr, p_k, flags.value[nk : nk + nc], p_x)

        def vjp_step(t, c, state):
            ctc, ctk, ctx = state
            cty = [None if a is None else row([a], t)[0] for a in ct_ys]
            in_cts = cotangents.vjp(
                step,
                [*consts, *c, *row(xs, t)],
                out_avals,
                [*ctc, *cty],
                [*p_k, *p_c, *p_x],
            )
            in_cts = cotangents.float_or_none(in_cts, k_avals + c_avals + x_avals_t)
            ctx = [
                a if a is None else lax.dynamic_update_index_in_dim(a, g, at(t), 0)
                for a, g in zip(ctx, in_cts[nk + nc :])
            ]
            return in_cts[nk : nk + nc], cotangents.add_into(ctk, in_cts[:nk]), ctx

        x_avals_t = avals(sp.body.jaxpr.invars[nk + nc :])
        state = (
            cotangents.float_or_none(list(ct_final), c_avals),
            cotangents.float_or_none([None] * nk, k_avals),
            cotangents.float_or_none([None] * len(x_avals), x_avals),
        )
        ct_init, ct_k, ct_xs = revolve.reverse(advance, vjp_step, init, n, slots, state)
        in_cts = cotangents.fill([*ct_k, *ct_init, *ct_xs], k_avals + c_avals + x_avals)
        return in_cts[:nk], in_cts[nk : nk + nc], in_cts[nk + nc :]

    tag(bwd, LoopTag("scan"))
    run.defvjp(fwd, bwd, symbolic_zeros=True)
    return run
