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

import jax.numpy as jnp
from jax import lax

from revnet._engine import runtime_checks
from revnet._engine.boundary import distances


class Anchors(NamedTuple):
    """The anchors of one scan, as its backward pass reads them.

    Attributes:
      every: the number of steps between anchors.
      carries: one stacked array per carry leaf, ``[count(length, every), ...]``.
      report: None, or a function called (through ``jax.debug.callback``)
        with the drift at each anchor, in the order the loop runs (two
        readings at each: pooled over the carry's float leaves, as a
        :class:`revnet.DriftMonitor` reads it, and the largest leaf by leaf,
        as the boundary check reads it), and the number of anchors the loop
        used (a while loop's buffer has room for ``max_steps`` steps).
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
    anchors: Anchors,
    rebuilt: Sequence[Any],
    i: Any,
    drift: Any,
    scale: Sequence[Any] | None = None,
) -> tuple[list, Any]:
    """The carry to continue from before step ``i``, and the drift so far.

    Args:
      anchors: the stored carries.
      rebuilt: the carry before step ``i``, as the backward pass rebuilt it.
      i: the step (in the order the loop runs).
      drift: None, or the drift at each anchor measured so far.
      scale: None, or the norm of each float leaf of the loop's final carry
        (:func:`revnet._engine.boundary.norms`): each leaf's drift is measured
        against the larger of its size there and at the anchor.

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
        # Read from the carry continued from (the stored anchor at anchors),
        # not from the slice: a slice with two readers is copied out.
        # Two readings: over all leaves together (a DriftMonitor's), and leaf
        # by leaf against each one's size (the boundary check's).
        now = jnp.stack(distances(rebuilt, carry, scale))
        d = jnp.where(at, now, drift[slot])
        drift = lax.dynamic_update_index_in_dim(drift, d, slot, 0)
    return carry, drift


def start(anchors: Anchors, slots: int) -> Any:
    """Empty drift readings for ``slots`` anchors (None without a report):
    two at each, pooled over the carry's leaves and leaf by leaf."""
    if anchors.report is None:
        return None
    return jnp.zeros((slots, 2), jnp.float32)


def report(anchors: Anchors, drift: Any, used: Any) -> None:
    """Sends the drift at the first ``used`` anchors to the report, if any."""
    if anchors.report is not None:
        runtime_checks.host_callback(anchors.report, drift, used)
