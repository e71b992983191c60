"""Anchors: carries stored every ``k`` steps of a loop that is run backwards.

A reversed scan rebuilds each carry from the next one by inversion, so the
rounding error of every step is carried into all the steps before it. With
anchors, the forward pass also stores the carry before every ``k``-th step
(``ceil(length / k)`` carries, the initial one included). The backward pass
still rebuilds carries by inversion, but before running the step in front of
an anchor it measures how far the rebuilt carry is from the stored one (the
*drift*) and continues from the stored one. Reconstruction error therefore
accumulates over at most ``k`` steps, for ``O(length / k)`` carries of memory
and no extra body evaluation.

Steps are counted in the order the loop runs them (``i``), which is the
reverse of the ``xs`` index ``t`` when the scan runs in reverse. The drift of
anchor ``j`` is the relative L2 distance, over the carry's floating-point
leaves, between the carry the backward pass rebuilt at step ``j * k`` (from
the exact carry at step ``min((j + 1) * k, length)``) and the stored one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from revnet._engine import runtime_checks
from revnet._engine.cotangents import is_float


class Anchors(NamedTuple):
    """The anchors of one scan, as its backward pass reads them.

    Attributes:
      every: the number of steps between anchors.
      carries: one stacked array per carry leaf, ``[count(length, every), ...]``.
      report: None, or a function called (through ``jax.debug.callback``)
        with the drift at each anchor, in the order the loop runs, and the
        number of anchors the loop used (a while loop's buffer has room for
        ``max_steps`` steps).
    """

    every: int
    carries: Sequence[Any]
    report: Callable[[Any, Any], None] | None = None


def count(length: int, every: int) -> int:
    """The number of anchors of a loop of ``length`` steps."""
    return -(-length // every)


def slots(anchors: Anchors) -> int:
    """The number of anchors the buffers have room for."""
    return anchors.carries[0].shape[0] if anchors.carries else 0


def empty(carry: Sequence[Any], slots: int) -> list:
    """Zero buffers for ``slots`` anchors of ``carry`` (or any ``slots`` rows of
    these values: a while loop's stored leaves).

    Built from ``zeros_like`` so that each slot has its carry's type (its
    sharding under Explicit mesh axes, its varying axes inside ``shard_map``);
    fresh ``jnp.zeros`` would be replicated, and ``keep``'s ``where`` refuses
    mixing the two.
    """
    return [jnp.broadcast_to(jnp.zeros_like(c), (slots, *jnp.shape(c))) for c in carry]


def keep(buffers: Sequence[Any], carry: Sequence[Any], i: Any, every: int) -> list:
    """``buffers`` with ``carry`` written at anchor ``i // every`` when ``i`` is
    a multiple of ``every`` (the carry is the one before step ``i``)."""
    slot, at = i // every, i % every == 0
    return [
        lax.dynamic_update_index_in_dim(
            b,
            jnp.where(at, c, lax.dynamic_index_in_dim(b, slot, keepdims=False)),
            slot,
            0,
        )
        for b, c in zip(buffers, carry)
    ]


def restore(
    anchors: Anchors, rebuilt: Sequence[Any], i: Any, drift: Any
) -> tuple[list, Any]:
    """The carry to continue from before step ``i``, and the drift so far.

    Args:
      anchors: the stored carries.
      rebuilt: the carry before step ``i``, as the backward pass rebuilt it.
      i: the step (in the order the loop runs).
      drift: None, or the drift at each anchor measured so far.

    Returns:
      ``(carry, drift)``: where ``i`` is a multiple of ``anchors.every``, the
      stored anchor, with its distance from ``rebuilt`` written into
      ``drift``; elsewhere ``rebuilt`` and ``drift`` unchanged.
    """
    slot, at = i // anchors.every, i % anchors.every == 0
    stored = [
        lax.dynamic_index_in_dim(b, slot, keepdims=False) for b in anchors.carries
    ]
    carry = [jnp.where(at, s, r) for s, r in zip(stored, rebuilt)]
    if drift is not None:
        d = jnp.where(at, relative_distance(rebuilt, stored), drift[slot])
        drift = lax.dynamic_update_index_in_dim(drift, d, slot, 0)
    return carry, drift


def relative_distance(a: Sequence[Any], b: Sequence[Any]) -> jax.Array:
    """``|a - b| / |b|`` in L2 over the floating-point leaves (0 when ``b`` is 0).

    No dtype is promoted (the loop may run under strict promotion): each leaf
    in its own dtype, at least float32, and the sums in the widest of them.
    """
    pairs = [(jnp.asarray(x), y) for x, y in zip(a, b) if is_float(x)]
    if not pairs:
        return jnp.float32(0.0)
    pairs = [(x.astype(_at_least_f32(x.dtype)), y) for x, y in pairs]
    wide = max((x.dtype for x, _ in pairs), key=lambda d: np.dtype(d).itemsize)
    num = sum(jnp.sum(jnp.square(x - y.astype(x.dtype))).astype(wide) for x, y in pairs)
    den = sum(jnp.sum(jnp.square(y.astype(x.dtype))).astype(wide) for x, y in pairs)
    value = jnp.where(
        den > 0, jnp.sqrt(num / jnp.where(den > 0, den, 1)), jnp.sqrt(num)
    )
    return value.astype(jnp.float32)


def _at_least_f32(dtype: Any) -> Any:
    return dtype if np.dtype(dtype).itemsize >= 4 else np.dtype(np.float32)


def start(anchors: Anchors, slots: int) -> Any:
    """Empty drift readings for ``slots`` anchors (None without a report)."""
    if anchors.report is None:
        return None
    return jnp.zeros((slots,), jnp.float32)


def report(anchors: Anchors, drift: Any, used: Any) -> None:
    """Sends the drift at the first ``used`` anchors to the report, if any."""
    if anchors.report is not None:
        runtime_checks.host_callback(anchors.report, drift, used)
