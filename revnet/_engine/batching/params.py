"""Which equations with batched inputs keep each example at its leading
position, read from their params: the per-primitive rules of
:mod:`revnet._engine.batching.axes` (``dot_general``'s batch dimensions, a
``gather``'s dimension numbers, a ``transpose``'s permutation, ...).

Each rule answers for an equation whose batched inputs and outputs all lead
with the batch's shape (checked before); a rule that cannot tell says no.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from revnet._engine import jaxpr as jx

UNBATCHED, LEADING, MIXED = 0, 1, -1

# Params that say nothing about axes.
HARMLESS = frozenset(
    {
        "accuracy",
        "new_dtype",
        "weak_type",
        "sharding",
        "out_sharding",
        "out_dtype",
        "y",
        "precision",
        "preferred_element_type",
        "exponent_bits",
        "mantissa_bits",
        "layout",
        "context_mesh",
        "unconstrained_dims",
        "dst_sharding",
        "axis_name",
        "rounding_method",
    }
)


def in_place(shape: tuple, out: tuple) -> bool:
    """Whether an elementwise equation with results of shape ``out`` reads
    its operand of ``shape`` position by position: the same shape, or the
    same rank with axes of size 1 that it broadcasts (``x[..., None] >=
    knots``; the leading axes, the batch's, were checked before)."""
    return len(shape) == len(out) and all(a in (b, 1) for a, b in zip(shape, out))


def _free(axes: Any, k: int) -> bool:
    """Whether the axes ``axes`` (an int or ints) all lie past the batch's."""
    if axes is None:
        return True
    if np.ndim(axes) == 0:  # an int, or a NumPy integer (jnp.roll's axis)
        axes = (axes,)
    return all(int(a) >= k for a in axes)


def _dot_general(eqn, flags, k) -> bool:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lead = tuple(range(k))
    lf, rf = flags
    if lf == LEADING and rf == LEADING:
        return tuple(lb[:k]) == lead and tuple(rb[:k]) == lead
    if lf == LEADING:
        if tuple(lb[:k]) == lead:
            return True
        return not lb and _free(lc, k)
    # The output leads with the batch dimensions, then the lhs's free ones.
    return tuple(rb[:k]) == lead and len(lb) >= k


def _conv(eqn, flags, k) -> bool:
    dn = eqn.params["dimension_numbers"]
    return (
        k == 1
        and flags[1] == UNBATCHED
        and dn.lhs_spec[0] == 0
        and dn.out_spec[0] == 0
        and eqn.params.get("batch_group_count", 1) == 1
    )


def keeps_leading(eqn, flags, k) -> bool:
    """Whether an equation with batched inputs keeps the leading axes."""
    p = eqn.params
    name = jx.primitive_name(eqn)
    if name == "dot_general":
        return _dot_general(eqn, flags, k)
    if name == "conv_general_dilated":
        return _conv(eqn, flags, k)
    if name == "transpose":
        return tuple(p["permutation"][:k]) == tuple(range(k))
    if name == "broadcast_in_dim":
        return tuple(p["broadcast_dimensions"][:k]) == tuple(range(k))
    if name == "reshape":
        return p.get("dimensions") is None
    if name == "gather":
        return _gather(eqn, flags, k)
    if name in ("scatter", "scatter-add"):
        return flags[1] == UNBATCHED and _whole(eqn, k)
    if name in ("slice", "pad", "dynamic_slice"):
        return _untouched(eqn, k)
    keys = set(p) - HARMLESS
    axis_keys = {"axes", "axis", "dimension", "dimensions"}
    if keys <= axis_keys | {"reverse", "index_dtype", "is_stable", "num_keys", "sizes"}:
        return all(_free(p[a], k) for a in keys & axis_keys)
    return False


def _gather(eqn, flags, k) -> bool:
    """A gather that keeps each example's values at its own leading position.

    By indices that read no example (``x[..., perm]``): it takes whole batch
    axes of the operand and keeps them leading. By batched indices (bucket
    indices, as in a spline's ``knots[jnp.searchsorted(knots, x)]``): each
    output position reads the indices at its own position when the output's
    leading axes are the indices' (no slice axis before them), and the
    operand must be read by no example (a table) or at the same example
    (``take_along_axis``: its leading axes paired with the indices' as
    batching axes).
    """
    dn = eqn.params["dimension_numbers"]
    if flags[1] != UNBATCHED:
        if not _free(tuple(dn.offset_dims), k):
            return False
        pairs = set(zip(dn.operand_batching_dims, dn.start_indices_batching_dims))
        return flags[0] == UNBATCHED or all((a, a) in pairs for a in range(k))
    return _whole(eqn, k)


def _whole(eqn, k) -> bool:
    """A gather or scatter by indices that read no example (``x[..., perm]``,
    ``z.at[..., perm].set(x)``) whose windows take whole batch axes of the
    operand and keep them leading."""
    dn, shape = eqn.params["dimension_numbers"], jx.aval(eqn.invars[0]).shape
    if jx.primitive_name(eqn) == "gather":
        sizes, windows = eqn.params["slice_sizes"], dn.offset_dims
        named = {*dn.start_index_map, *dn.collapsed_slice_dims}
    else:
        sizes, windows = jx.aval(eqn.invars[2]).shape, dn.update_window_dims
        named = {*dn.scatter_dims_to_operand_dims, *dn.inserted_window_dims}
    named |= {*dn.operand_batching_dims}
    return all(b not in named and sizes[b] == shape[b] for b in range(k)) and tuple(
        windows[:k]
    ) == tuple(range(k))


def _untouched(eqn, k) -> bool:
    """A slice or pad that leaves the leading axes whole."""
    name, p = jx.primitive_name(eqn), eqn.params
    shape = jx.aval(eqn.invars[0]).shape
    if name == "slice":
        strides = p.get("strides") or (1,) * len(shape)
        return all(
            p["start_indices"][a] == 0
            and p["limit_indices"][a] == shape[a]
            and strides[a] == 1
            for a in range(k)
        )
    if name == "pad":
        return all(tuple(c) == (0, 0, 0) for c in p["padding_config"][:k])
    if name == "dynamic_slice":
        return tuple(p["slice_sizes"][:k]) == tuple(shape[:k])
    return False
