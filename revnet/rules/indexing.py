"""Indexing that permutes: ``gather`` (``x[..., perm]``, ``jnp.take``),
``scatter`` (``z.at[..., perm].set(x)``) and ``scatter-add``, with known
indices.

A gather is linear in its operand, ``y = G x`` for a 0/1 selection matrix
``G``; a scatter writes its updates the other way, ``y = o + S u``. When the
indices reach every element exactly once, ``G`` and ``S`` are permutation
matrices, whose inverses are their transposes: a gather is solved by a
scatter-add of its output into zeros, and a scatter by a gather (the pairs of
dimension numbers below are JAX's own transposes of the two). Their
log-determinant terms are zero. A scatter-add solved for its operand
subtracts the known updates, whatever the indices.

A map whose output is not its unknown's size is refused at trace time.
Whether the indices form a permutation depends on their values, so the rules
count, at run time, how often each element is reached (``S 1``): an element
not reached exactly once is rebuilt as NaN, which the run-time checks report
(:func:`revnet.set_runtime_checks`), never as a finite wrong value.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from revnet._engine import SMOOTH, NotInvertibleError, define
from revnet.rules._solve import one_unknown, with_value

_MODES = ("indices_are_sorted", "unique_indices", "mode")


def _scatter_numbers(dn: Any) -> lax.ScatterDimensionNumbers:
    """The scatter that writes back what a gather of ``dn`` reads."""
    return lax.ScatterDimensionNumbers(
        update_window_dims=dn.offset_dims,
        inserted_window_dims=dn.collapsed_slice_dims,
        scatter_dims_to_operand_dims=dn.start_index_map,
        operand_batching_dims=dn.operand_batching_dims,
        scatter_indices_batching_dims=dn.start_indices_batching_dims,
    )


def _gather_numbers(dn: Any, operand_shape, updates_shape):
    """The gather (numbers, slice sizes) that reads what a scatter of ``dn``
    writes."""
    numbers = lax.GatherDimensionNumbers(
        offset_dims=dn.update_window_dims,
        collapsed_slice_dims=dn.inserted_window_dims,
        start_index_map=dn.scatter_dims_to_operand_dims,
        operand_batching_dims=dn.operand_batching_dims,
        start_indices_batching_dims=dn.scatter_indices_batching_dims,
    )
    windows = iter(dn.update_window_dims)
    sizes = tuple(
        1
        if d in dn.inserted_window_dims or d in dn.operand_batching_dims
        else updates_shape[next(windows)]
        for d in range(len(operand_shape))
    )
    return numbers, sizes


def _same_size(what: str, unknown: Any, other_shape) -> None:
    if int(np.prod(unknown.shape)) != int(np.prod(other_shape)):
        raise NotInvertibleError(
            f"{what} from shape {tuple(unknown.shape)} to {tuple(other_shape)} "
            "does not reach each element exactly once; only a permutation is "
            "invertible"
        )


def _inexact(what: str, aval: Any) -> None:
    if not jnp.issubdtype(aval.dtype, jnp.inexact):
        raise NotInvertibleError(f"integer {what} is not invertible")


def _once(aval: Any, indices, updates_shape, dn, params) -> Any:
    """1 where the scatter of ``dn`` reaches an element of an operand like
    ``aval`` exactly once, NaN elsewhere. It is built from the indices alone, a
    known factor, so that the solution is invertible in turn."""
    zeros = jnp.zeros(aval.shape, aval.dtype)
    ones = jnp.ones(updates_shape, aval.dtype)
    reached = lax.scatter_add(zeros, indices, ones, dn, **params)
    return jnp.where(reached == 1, 1.0, jnp.nan).astype(aval.dtype)


def gather(outs, ins, *, in_avals, dimension_numbers, **params):
    """``y = x[indices]``, solved as ``x = scatter-add(0, indices, y)``."""
    (y,) = outs
    if one_unknown(ins) != 0:
        raise NotInvertibleError("gather is solved for its operand, not its indices")
    aval = in_avals[0]
    _inexact("gather", aval)
    _same_size("gather", aval, y.shape)
    dn, modes = _scatter_numbers(dimension_numbers), {k: params[k] for k in _MODES}
    x = lax.scatter_add(jnp.zeros(aval.shape, aval.dtype), ins[1], y, dn, **modes)
    return with_value(ins, 0, x * _once(aval, ins[1], y.shape, dn, modes))


def _scatter(add: bool):
    """A rule for ``scatter-add`` (``add``) or ``scatter``."""
    what = "scatter-add" if add else "scatter"

    def rule(outs, ins, *, in_avals, dimension_numbers, **params):
        (y,) = outs
        i = one_unknown(ins)
        operand, indices, updates = ins
        modes = {k: params[k] for k in _MODES}
        if i == 0 and add:  # y = o + S u: subtract what was added
            zeros = jnp.zeros(in_avals[0].shape, in_avals[0].dtype)
            return with_value(
                ins, 0, y - lax.scatter_add(zeros, indices, updates, dimension_numbers)
            )
        if i != 2:
            raise NotInvertibleError(
                f"{what} is solved for its updates, with its operand and indices "
                "known; the elements it overwrites are lost"
                if i == 0
                else f"{what} is solved for its operand or updates, not its indices"
            )
        aval = in_avals[2]
        _inexact(what, aval)
        _same_size(what, aval, y.shape)
        written = (y - operand) if add else y
        once = _once(in_avals[0], indices, aval.shape, dimension_numbers, modes)
        numbers, sizes = _gather_numbers(dimension_numbers, y.shape, aval.shape)
        u = lax.gather(written * once, indices, numbers, sizes, **modes)
        return with_value(ins, 2, u)

    return rule


# name -> rule; every term of the log-determinant is zero.
# Permutations by known indices: smooth, volume preserving.
define("gather", inverse=gather, continuity=SMOOTH, log_det=0)
define("scatter-add", inverse=_scatter(add=True), continuity=SMOOTH, log_det=0)
define("scatter", inverse=_scatter(add=False), continuity=SMOOTH, log_det=0)
