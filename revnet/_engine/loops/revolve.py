"""Binomial checkpointing: a loop's backward pass from a fixed number of snapshots.

A loop of ``n`` steps whose body cannot be inverted is reversed from its
initial carry with ``slots`` snapshots (the initial carry is the first). The
schedule is Griewank's binomial one (``revolve``). Write ``b(s, r) = C(s + r,
s)``, the most steps that ``s`` snapshots reverse evaluating no step more than
``r`` times. To reverse ``L`` steps from a snapshot with ``s`` snapshots in all
(that one included), take the smallest ``r`` with ``b(s, r) >= L``; advance
``m = max(1, L - b(s - 1, r), b(s, r - 2))`` steps, store a snapshot there,
reverse the right part with one snapshot fewer, then the left part with as
many. That evaluates the body ``r * L - b(s + 1, r - 1)`` times, the fewest
possible (``tests/loops/test_modes.py`` checks the schedule's count against a
dynamic programme). The number of steps is read at run time, so it need not
be known when the loop is traced (``while_loop``), and the schedule runs inside
one ``lax.while_loop``: memory is ``slots`` carries, whatever ``n`` is.

Counts: with ``s`` snapshots and ``n`` steps, the backward pass evaluates the
body at most ``n * (r + 1)`` times (the ``+ 1`` is the evaluation whose VJP is
taken), and ``r <= ceil(log2 n)`` once ``s >= ceil(log2 n)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

# The largest int32: loop counters and step counts are int32 (also the bound
# revnet._checks puts on max_steps).
INT32_MAX = 2**31 - 1

# The default number of snapshots of a loop with no bound on its steps: it
# keeps ``r <= 16`` up to ``2**16`` steps, and ``r <= 21`` up to a million.
UNBOUNDED_DEFAULT = 16


def default_slots(bound: int | None) -> int:
    """The default number of snapshots for a loop of at most ``bound`` steps.

    ``ceil(log2(bound))`` (at least 1), for which every step is evaluated at
    most ``ceil(log2 n) + 1`` times in the backward pass of an ``n``-step loop;
    :data:`UNBOUNDED_DEFAULT` when there is no bound.
    """
    if bound is None:
        return UNBOUNDED_DEFAULT
    return max(1, math.ceil(math.log2(max(bound, 1))))


def _grow(b: jnp.ndarray, a: Any, j: Any) -> jnp.ndarray:
    """``C(a + j, j)`` from ``b = C(a + j - 1, j - 1)``, saturating at int32 max."""
    big = b > INT32_MAX // (a + j)
    return jnp.where(big, INT32_MAX, b * (a + j) // j)


@jax.jit
def split(length: Any, snapshots: Any) -> jnp.ndarray:
    """Where to store the next snapshot when reversing ``length >= 2`` steps.

    Args:
      length: the steps left to reverse from the current snapshot (int32).
      snapshots: snapshots available, the current one included (>= 2).

    Returns:
      The number of steps to advance before storing, in ``[1, length - 1]``.
    """
    length = jnp.asarray(length, jnp.int32)
    s = jnp.asarray(snapshots, jnp.int32)

    def more(state):
        return state[0] < length

    def step(state):
        full, before, _, fewer, r = state
        r = r + 1
        return _grow(full, s, r), full, before, _grow(fewer, s - 1, r), r

    one, zero = jnp.int32(1), jnp.int32(0)
    _, _, two_before, fewer, _ = lax.while_loop(
        more, step, (one, zero, zero, one, zero)
    )
    return jnp.maximum(jnp.maximum(one, length - fewer), two_before)


def reverse(
    advance: Callable[[Any, list], list],
    vjp_step: Callable[[Any, list, Any], Any],
    init: Sequence[Any],
    steps: Any,
    slots: int,
    state: Any,
) -> Any:
    """Runs a loop's steps backwards from its initial carry, by binomial schedule.

    Args:
      advance: ``advance(t, carry) -> carry``, step ``t`` of the loop.
      vjp_step: ``vjp_step(t, carry, state) -> state``, the backward of step
        ``t`` given the carry it starts from (state: cotangents, typically).
      init: the carry before step 0, a list of arrays.
      steps: the number of steps the loop took (an int32 scalar, traced).
      slots: how many carries may be held at once, ``init`` included (>= 1).
      state: the initial state given to the first ``vjp_step`` (for ``t =
        steps - 1``).

    Returns:
      The state after ``vjp_step`` has run for ``t = steps - 1, ..., 0``.
    """
    # Snapshot 0 is ``init``; broadcasting it (rather than filling zeros) keeps
    # a weakly typed leaf weak, so each step is differentiated at the types
    # ``lax.scan`` would use.
    stack = [jnp.broadcast_to(x, (slots, *jnp.shape(x))) for x in init]
    where = jnp.zeros((slots,), jnp.int32)

    def run(c, start, stop):
        return lax.fori_loop(start, stop, advance, c)

    def outer(loop):
        t, depth, stack, where, state = loop
        top = depth - 1
        c = [lax.dynamic_index_in_dim(x, top, keepdims=False) for x in stack]

        def room(p):
            s, _, depth, _, _ = p
            return jnp.logical_and(s < t, depth < slots)

        def place(p):
            s, c, depth, stack, where = p
            m = split(t - s + 1, slots - depth + 1)
            c = run(c, s, s + m)
            stack = [
                lax.dynamic_update_index_in_dim(a, x, depth, 0)
                for a, x in zip(stack, c)
            ]
            where = where.at[depth].set(s + m)
            return s + m, c, depth + 1, stack, where

        s, c, depth, stack, where = lax.while_loop(
            room, place, (where[top], c, depth, stack, where)
        )
        c = run(c, s, t)
        state = vjp_step(t, c, state)
        depth = jnp.where(where[depth - 1] == t, depth - 1, depth)
        return t - 1, depth, stack, where, state

    start = (jnp.asarray(steps, jnp.int32) - 1, jnp.int32(1), stack, where, state)
    return lax.while_loop(lambda loop: loop[0] >= 0, outer, start)[-1]
