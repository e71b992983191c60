"""The forward loops of ``revnet.while_loop`` and ``revnet.scan``, and their cache.

A loop's forward pass is one jitted ``lax.while_loop`` or ``lax.scan`` over
the body. Besides the final carry (and a scan's ``ys``) it records what the
backward pass reads: the trip count (a while loop's), the carry leaves the
mode stores at every step (:mod:`.store`), the decisions a while loop's body
returns after its carry (one per step, in room for ``max_steps``: a scan's
are among its ``ys``), and, when asked for, the carry every ``k`` steps
(:mod:`.anchors`). Every forward loop returns a :class:`Ran`.

The jitted forward loops are cached by what they compute (the body's jaxpr by
structure, its nested constants by identity; derivative rules do not change a
forward value), so an eager loop called again with the same body reuses JAX's
compiled forward loop. The custom VJP around it is made per call: its backward
takes the rules of the current trace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from revnet._engine import fingerprint
from revnet._engine import jaxpr as jx
from revnet._engine.cache import LRU
from revnet._engine.jaxpr import Body, ScanParams, eval_body
from revnet._engine.jaxpr import scan as plain_scan
from revnet._engine.loops import anchors as anc
from revnet._engine.loops.store import stored_leaves
from revnet._engine.sharded_types import zeros

_FORWARDS = LRU(64)


class Ran(NamedTuple):
    """What a forward loop returns.

    Attributes:
      steps: the trip count (an int32 scalar), or None when it is known at
        trace time (a scan's length).
      final: the final carry, a list of arrays.
      ys: a scan's stacked outputs; a while loop's stored decisions, the
        body's results after its carry, one row per step (``max_steps`` rows).
      stored: the stored carry leaves, stacked over the steps.
      anchors: the anchor buffers (empty without anchors).
    """

    steps: Any
    final: Sequence[Any]
    ys: Sequence[Any]
    stored: Sequence[Any]
    anchors: Sequence[Any]


class Forwards(NamedTuple):
    """The forward loops of one loop: ``loop(*args) -> Ran``.

    Attributes:
      primal: the loop without anchors (what an enclosing ``@invertible``
        sees and inverts, and what a call without a VJP runs).
      anchored: the loop a differentiated call runs; it also stores anchors
        every ``every`` steps.
      every: the anchor spacing, or None (then both loops are the same).
    """

    primal: Callable[..., Ran]
    anchored: Callable[..., Ran]
    every: int | None


def _cached(key: tuple, make: Callable[[int | None], Any], every: int | None):
    forward = _FORWARDS.get((*key, every))
    if forward is None:
        forward = make(every)
        _FORWARDS.put((*key, every), forward)
    return forward


def _forwards(key, make, read, anchor_every: int | None, steps) -> Forwards:
    """The cached forward loops; no anchors when none are asked for or the loop
    takes no step."""
    primal = _cached(key, make, None)

    def ran(forward):
        return lambda *args: read(forward(*args))

    if anchor_every is None or steps == 0:
        return Forwards(ran(primal), ran(primal), None)
    return Forwards(ran(primal), ran(_cached(key, make, anchor_every)), anchor_every)


def while_forwards(
    body_jaxpr: Any,
    cond_jaxpr: Any,
    bound: int | None,
    stored: tuple[bool, ...],
    anchor_every: int | None,
) -> Forwards:
    """The forward loops ``(body_consts, cond_consts, carry) -> Ran`` of a while loop.

    Args:
      body_jaxpr, cond_jaxpr: the body and condition, constants first; the
        body returns the carry, then the decisions it stores (a bounded loop
        only), which the loop writes at every step into ``Ran.ys``.
      bound: the largest number of steps, or None.
      stored: for each carry leaf, whether it is stored at every step.
      anchor_every: the anchor spacing asked for, or None; room is made for
        the anchors of ``bound`` steps (of one step without a bound: the
        initial carry).
    """
    key = (
        "while_loop",
        fingerprint.primal(body_jaxpr),
        fingerprint.primal(cond_jaxpr),
        bound,
        stored,
    )
    body, cond = Body(body_jaxpr, ()), Body(cond_jaxpr, ())

    def make(every):
        return _while_forward(body, cond, bound, stored, every)

    def read(out):
        n, final, bufs, decided, marks = out
        return Ran(n, final, decided, bufs, marks)

    return _forwards(key, make, read, anchor_every, bound)


def _while_forward(
    body: Body, cond: Body, bound: int | None, stored, every: int | None
):
    """``forward(bk, ck, carry) -> (steps, final, stored leaves, decisions,
    anchors)``, jitted; ``anchors`` is empty unless ``every`` is given."""
    nc = len(stored)  # one flag per carry leaf
    decided = [jx.aval(v) for v in body.jaxpr.outvars[nc:]]
    # At least one row: a loop bounded by 0 steps writes none, but its
    # (never run) step must still trace.
    rows = 1 if bound is None else max(bound, 1)

    def write(bufs, values, n):
        return [
            lax.dynamic_update_index_in_dim(b, x, n, 0) for b, x in zip(bufs, values)
        ]

    def forward(bk, ck, carry):
        def go(state):
            n, c, _, _, _ = state
            p = eval_body(cond, *ck, *c)[0]
            return p if bound is None else jnp.logical_and(p, n < bound)

        def step(state):
            n, c, bufs, ds, marks = state
            bufs = write(bufs, stored_leaves(c, stored), n)
            if every is not None:
                marks = anc.keep(marks, c, n, every)
            out = eval_body(body, *bk, *c)
            return n + 1, out[:nc], bufs, write(ds, out[nc:], n), marks

        # Each row has its leaf's type (its sharding under Explicit axes).
        bufs = anc.empty(stored_leaves(carry, stored), rows)
        ds = [zeros(jx.stacked(a, rows)) for a in decided]
        marks = []
        if every is not None:
            marks = anc.empty(carry, 1 if bound is None else anc.count(bound, every))
        state = (jnp.zeros((), jnp.int32), list(carry), bufs, ds, marks)
        return lax.while_loop(go, step, state)

    return jax.jit(forward)


def scan_forwards(
    sp: ScanParams, stored: tuple[bool, ...], anchor_every: int | None
) -> Forwards:
    """The forward loops ``(consts, init, xs) -> Ran`` of the scan ``sp``.

    Args:
      sp: the scan; its body's inputs are the constants, carry and ``xs``.
      stored: for each carry leaf, whether it is stored at every step.
      anchor_every: the anchor spacing asked for, or None.
    """
    key = (
        "scan",
        fingerprint.primal(sp.body.jaxpr),
        sp.num_consts,
        sp.num_carry,
        sp.length,
        sp.reverse,
        repr(sp.unroll),
        stored,
    )

    def make(every):
        return _scan_forward(sp, stored, every)

    def read(out):
        final, (ys, bufs), marks = out
        return Ran(None, final, ys, bufs, marks)

    return _forwards(key, make, read, anchor_every, sp.length)


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
