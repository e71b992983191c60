"""The custom VJPs of revnet's loops: forward loop, backward reversed loop.

:func:`scan_function` and :func:`while_function` build the ``jax.custom_vjp``
functions behind ``revnet.scan`` and ``revnet.while_loop``: the forward pass
runs the loop and saves only the final carry (and ``xs``, ``ys``, the trip
count, the constants); the backward pass walks back step by step, rebuilding
each carry from the next by the body's plan, fused with the body's VJP. Their
backward functions are tagged, so that the analysis recognises a loop inside
an ``@invertible`` function. Both are cached by everything they close over
(the body's jaxpr by identity), so an eager loop called again with the same
body reuses its function and JAX's compiled forward loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from revnet._engine import checks, cotangents, fingerprint
from revnet._engine.analysis import LRU
from revnet._engine.calls import LoopTag
from revnet._engine.interpreter import run_plan
from revnet._engine.jaxpr import Body, ScanParams, aval, eval_body, tag
from revnet._engine.plan import Plan
from revnet._engine.scan import reversed_scan

# The jitted forward loops of recent calls, keyed by what they compute (the
# body's structure and its nested constants by identity; derivative rules do
# not change a forward value): an eager loop called again reuses its compiled
# forward loop. The custom VJP around it is made per call: its backward takes
# the rules of the current trace.
_FORWARDS = LRU(64)


def _avals(vars_: Any) -> list[Any]:
    return [aval(v) for v in vars_]


def scan_function(sp: ScanParams, plan: Plan):
    """``run(consts, init, xs) -> (final, ys)``, a custom VJP for the scan ``sp``.

    Args:
      sp: the scan; its body's inputs are the constants, carry and ``xs``.
      plan: the body's plan, rebuilding the carry from the outputs.
    """
    key = (
        "scan",
        fingerprint.primal(sp.body.jaxpr),
        sp.num_consts,
        sp.num_carry,
        sp.length,
        sp.reverse,
        repr(sp.unroll),
    )
    forward = _FORWARDS.get(key)
    if forward is None:
        forward = _scan_forward(sp)
        _FORWARDS.put(key, forward)
    return _make_scan(sp, plan, forward)


def while_function(
    body_jaxpr,
    cond_jaxpr,
    plan: Plan,
    nk: int,
    bound: int | None,
    step_hooks: Sequence[Any] = (),
):
    """``run(body_consts, cond_consts, carry) -> carry``, a custom VJP while loop.

    Args:
      body_jaxpr, cond_jaxpr: the body and condition, constants first.
      plan: the body's plan, rebuilding the carry from the new carry.
      nk: the number of the body's constants.
      bound: the largest number of steps, or None.
      step_hooks: callbacks given the remaining-step counter of every backward
        iteration at run time (a testing aid; read when the backward is traced).
    """
    key = (
        "while_loop",
        fingerprint.primal(body_jaxpr),
        fingerprint.primal(cond_jaxpr),
        bound,
    )
    forward = _FORWARDS.get(key)
    if forward is None:
        forward = _while_forward(Body(body_jaxpr, ()), Body(cond_jaxpr, ()), bound)
        _FORWARDS.put(key, forward)
    return _make_while(body_jaxpr, cond_jaxpr, plan, nk, forward, step_hooks)


def _while_forward(body: Body, cond: Body, bound: int | None):
    """``forward(bk, ck, carry) -> (steps, final)``, jitted."""

    def forward(bk, ck, carry):
        def go(state):
            n, c = state
            p = eval_body(cond, *ck, *c)[0]
            return p if bound is None else jnp.logical_and(p, n < bound)

        def step(state):
            n, c = state
            return n + 1, eval_body(body, *bk, *c)

        return lax.while_loop(go, step, (jnp.zeros((), jnp.int32), list(carry)))

    return jax.jit(forward)


def _scan_forward(sp: ScanParams):
    """``forward(consts, init, xs) -> (final, ys)``, jitted."""
    nc = sp.num_carry

    def forward(consts, init, xs):
        def body(c, x):
            out = eval_body(sp.body, *consts, *c, *x)
            return out[:nc], out[nc:]

        return lax.scan(
            body,
            list(init),
            list(xs),
            length=sp.length,
            reverse=sp.reverse,
            unroll=sp.unroll,
        )

    return jax.jit(forward)


def _make_while(body_jaxpr, cond_jaxpr, plan, nk: int, forward, step_hooks):
    """The custom-VJP function ``run(body_consts, cond_consts, carry) -> carry``."""
    k_avals = _avals(body_jaxpr.invars[:nk])
    c_avals = _avals(body_jaxpr.invars[nk:])
    q_avals = _avals(cond_jaxpr.invars[: len(cond_jaxpr.invars) - len(c_avals)])

    @jax.custom_vjp
    def run(bk, ck, carry):
        return forward(bk, ck, carry)[1]

    def fwd(bk, ck, carry):
        n, final = forward(bk, ck, carry)
        return final, (bk, final, n)

    def bwd(res, cts):
        bk, final, n = res
        hooks = tuple(step_hooks)

        def go(state):
            return state[0] > 0

        messages: list[str] = []

        def step(state):
            m, c, ctc, ctk, bad = state
            for hook in hooks:
                jax.debug.callback(hook, m)
            with checks.scope() as sc:
                prev, in_cts = run_plan(plan, body_jaxpr, list(bk), list(c), list(ctc))
            bad = checks.merge(bad, sc, messages)
            in_cts = cotangents.float_or_none(in_cts, k_avals + c_avals)
            ctk = cotangents.add_into(ctk, in_cts[:nk])
            return m - 1, prev, in_cts[nk:], ctk, bad

        state = (
            n,
            list(final),
            cotangents.float_or_none(list(cts), c_avals),
            cotangents.float_or_none([None] * nk, k_avals),
            jnp.int32(-1) if checks.enabled() else None,
        )
        with checks.scope() as top:
            _, _, ct_init, ct_k, bad = lax.while_loop(go, step, state)
            checks.record_index(bad, messages)
        checks.raise_if_failed(top)
        return (
            cotangents.fill(ct_k, k_avals),
            [cotangents.zeros(a) for a in q_avals],
            cotangents.fill(ct_init, c_avals),
        )

    tag(bwd, LoopTag("while_loop"))  # recognised by the analysis
    run.defvjp(fwd, bwd)
    return run


def _make_scan(sp: ScanParams, plan: Any, forward):
    """The custom-VJP function ``run(consts, init, xs) -> (final, ys)``."""
    nk, nc = sp.num_consts, sp.num_carry
    invars = sp.body.jaxpr.invars
    k_avals = _avals(invars[:nk])
    c_avals = _avals(invars[nk : nk + nc])
    x_avals = [a.update(shape=(sp.length, *a.shape)) for a in _avals(invars[nk + nc :])]
    known_xs = (True,) * len(x_avals)
    known_ys = (True,) * (len(sp.body.jaxpr.outvars) - nc)

    @jax.custom_vjp
    def run(consts, init, xs):
        return forward(consts, init, xs)

    def fwd(consts, init, xs):
        final, ys = forward(consts, init, xs)
        return (final, ys), (consts, xs, final, ys)

    def bwd(res, cts):
        consts, xs, final, ys = res
        ct_final, ct_ys = cts
        known = list(consts) + [None] * nc + list(xs)
        outs = list(final) + list(ys)
        with checks.scope() as top:
            _, in_cts = reversed_scan(
                sp, plan, known_xs, known_ys, known, outs, list(ct_final) + list(ct_ys)
            )
        checks.raise_if_failed(top)
        in_cts = cotangents.fill(in_cts, k_avals + c_avals + x_avals)
        return in_cts[:nk], in_cts[nk : nk + nc], in_cts[nk + nc :]

    tag(bwd, LoopTag("scan"))  # recognised by the analysis
    run.defvjp(fwd, bwd)
    return run
