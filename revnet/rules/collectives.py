"""Sharding and collectives: identity-like ``sharding_constraint``, ``reshard``,
``pvary``; ``ppermute``, ``all_gather``, ``all_to_all``.

The engine gives every solved input its type's sharding
(``revnet._engine.sharded_types.cast_like``): an Explicit sharding by a
``reshard``, varying axes by a ``pcast``, and an invariant value from a
varying one by an exact all-reduce of one device's copy. So the inverse of an
identity-like primitive is the identity on values. Collectives run inside
``shard_map`` bodies, whose rules are run per device (``_engine/structural/shard_map``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jax import lax

from revnet._engine import SMOOTH, NotInvertibleError, define


def _same_value(outs, ins, **params):
    """``sharding_constraint``, ``reshard``, ``pvary``: the value is unchanged,
    only its type; the engine casts it back to the input's type."""
    return [outs[0]]


def _axis_size(axis_name: Any) -> int:
    names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
    return int(np.prod([int(lax.axis_size(n)) for n in names]))


def _no_groups(what: str, axis_index_groups: Any) -> None:
    if axis_index_groups is not None:
        raise NotInvertibleError(
            f"{what} with axis_index_groups is not supported under sharding"
        )


def _ppermute(outs, ins, *, axis_name, perm, **params):
    """``y = ppermute(x, perm)``: ``x = ppermute(y, perm inverted)``.

    Only a permutation of every device along the axis is invertible: a device
    that receives nothing gets zeros, and what it held is lost.
    """
    n = _axis_size(axis_name)
    sources = sorted(s for s, _ in perm)
    dests = sorted(d for _, d in perm)
    if sources != list(range(n)) or dests != list(range(n)):
        raise NotInvertibleError(
            f"ppermute over the sharding axis {axis_name} of size {n} with the "
            f"partial permutation {tuple(perm)}: a device that receives nothing "
            "gets zeros, and what it held is lost"
        )
    back = tuple((d, s) for s, d in perm)
    return [lax.ppermute(outs[0], axis_name, back)]


def _all_gather(
    outs,
    ins,
    *,
    axis_name,
    all_gather_dimension,
    axis_size,
    tiled,
    axis_index_groups=None,
    in_avals,
    **params,
):
    """``y = all_gather(x)``: ``x`` is this device's slice of ``y``."""
    _no_groups("all_gather", axis_index_groups)
    (y,) = outs
    i = lax.axis_index(axis_name)
    d = all_gather_dimension
    if tiled:
        size = in_avals[0].shape[d]
        return [lax.dynamic_slice_in_dim(y, i * size, size, axis=d)]
    return [lax.dynamic_index_in_dim(y, i, axis=d, keepdims=False)]


def _all_to_all(
    outs, ins, *, axis_name, split_axis, concat_axis, axis_index_groups=None, **params
):
    """``y = all_to_all(x, split, concat)``: the exchange back,
    ``x = all_to_all(y, concat, split)`` (chunk ``j`` of device ``i`` goes home)."""
    _no_groups("all_to_all", axis_index_groups)
    return [lax.all_to_all(outs[0], axis_name, concat_axis, split_axis, tiled=True)]


# Collectives and placements: smooth. A per-device permutation of values
# (``ppermute``, ``all_to_all``) preserves volume; ``all_gather`` copies a slice
# to every device, which has no log-determinant.
define("sharding_constraint", inverse=_same_value, continuity=SMOOTH, log_det=0)
define("reshard", inverse=_same_value, continuity=SMOOTH, log_det=0)
define("pvary", inverse=_same_value, continuity=SMOOTH, log_det=0)
define("ppermute", inverse=_ppermute, continuity=SMOOTH, log_det=0)
define("all_gather", inverse=_all_gather, continuity=SMOOTH, log_det=None)
define("all_to_all", inverse=_all_to_all, continuity=SMOOTH, log_det=0)
