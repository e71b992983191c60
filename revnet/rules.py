"""The built-in inverse rules, grouped by family and registered in one table.

Each rule solves one primitive's equation for its unknown input from its
outputs and known inputs (see :func:`revnet.register_inverse` for the calling
convention); rules that need the inputs' shapes or dtypes declare the keyword
``in_avals``. Rules are built from ``jax.lax`` functions, so they trace, jit
and vmap like any JAX code. The families follow ``jax.lax``:

* arithmetic: ``add``, ``sub``, ``neg``, ``mul``, ``div`` (with trace-time
  checks refusing a constant zero factor);
* elementwise bijections: ``exp``, ``log``, ``tanh``, ``erf_inv``, ...,
  ``integer_pow`` with an odd power, widening ``convert_element_type``;
* ``cumsum``;
* shape and layout: ``reshape``, ``transpose``, ``broadcast_in_dim`` adding
  unit dimensions, ``rev``, ``concatenate``, ``split``;
* linear algebra: ``dot_general`` with a known square matrix;
* sharding and collectives: identity-like ``sharding_constraint``,
  ``reshard``, ``mesh_cast``, ``pvary`` (``pcast`` to varying); ``ppermute``
  (the inverse permutation), ``all_gather`` (this device's slice),
  ``all_to_all`` (the exchange back). ``psum`` has no inverse: it is only
  evaluated forward, on known inputs (a tensor-parallel reduction inside F).

:data:`TABLE` lists every rule with its properties; :func:`register_all` puts
them in the engine's registry. Structural rules (nested calls, ``scan``,
``select_n``, covering slices, ``shard_map``) live in the engine itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from revnet._engine import NotInvertibleError, registry

InverseRuleFn = Callable[..., Sequence[Any]]


# --------------------------------------------------------------------------- #
# Helpers shared by the rules.


def _unknown(ins: Sequence[Any]) -> list[int]:
    return [i for i, v in enumerate(ins) if v is None]


def _one_unknown(ins: Sequence[Any], what: str = "operand") -> int:
    idx = _unknown(ins)
    if len(idx) != 1:
        raise NotInvertibleError(
            f"{len(idx)} {what}s are unknown; an equation can be solved for one"
        )
    return idx[0]


def _check_not_broadcast(unknown_shape: Sequence[int], out: Any) -> None:
    if tuple(unknown_shape) != tuple(out.shape):
        raise NotInvertibleError(
            f"the unknown operand of shape {tuple(unknown_shape)} was broadcast to "
            f"{tuple(out.shape)}"
        )


def _with(ins: Sequence[Any], i: int, value: Any) -> list[Any]:
    out = list(ins)
    out[i] = value
    return out


# --------------------------------------------------------------------------- #
# Arithmetic: add, sub, neg, mul, div.


def _binary(solve: Callable[[Any, Any, int], Any], what: str = "") -> InverseRuleFn:
    """A rule for ``y = a op b`` solving the one unknown operand.

    ``solve(y, known, i)`` returns operand ``i`` from the output and the other
    operand. With ``what``, integer operands are refused (``what`` names the
    operation in the message).
    """

    def rule(outs, ins, *, in_avals, **params):
        (y,) = outs
        i = _one_unknown(ins)
        a = in_avals[i]
        _check_not_broadcast(a.shape, y)
        if what and not jnp.issubdtype(a.dtype, jnp.inexact):
            raise NotInvertibleError(f"integer {what} is not invertible")
        return _with(ins, i, solve(y, ins[1 - i], i))

    return rule


_add = _binary(lambda y, k, i: y - k)
_sub = _binary(lambda y, k, i: k - y if i == 1 else y + k)
_mul = _binary(lambda y, k, i: y / k, "multiplication")
_div = _binary(lambda y, k, i: y * k if i == 0 else k / y, "division")


def _neg(outs, ins, **params):
    return [-outs[0]]


def _has_zero(x: Any) -> bool:
    return x is not None and bool(np.any(np.asarray(x) == 0))


def _check_mul(statics, **params):
    for k in statics:
        if _has_zero(k):
            raise NotInvertibleError(
                "multiplication by a constant zero loses the other operand"
            )


def _check_div(statics, **params):
    num, den = statics
    if _has_zero(den):
        raise NotInvertibleError("division by a constant zero loses the numerator")
    if _has_zero(num):
        raise NotInvertibleError("a constant zero divided by a value loses the value")


ARITHMETIC = {
    "add": (_add, None),
    "add_any": (_add, None),
    "sub": (_sub, None),
    "neg": (_neg, None),
    "mul": (_mul, _check_mul),
    "div": (_div, _check_div),
}


# --------------------------------------------------------------------------- #
# Elementwise bijections.


def _unary(inverse: Callable[[Any], Any]) -> InverseRuleFn:
    def rule(outs, ins, **params):
        return [inverse(outs[0])]

    return rule


def _logit(y):
    return jnp.log(y) - jnp.log1p(-y)


UNARY = {
    "exp": jnp.log,
    "log": jnp.exp,
    "exp2": jnp.log2,
    "log1p": jnp.expm1,
    "expm1": jnp.log1p,
    "tanh": jnp.arctanh,
    "atanh": jnp.tanh,
    "logistic": _logit,
    "sinh": jnp.arcsinh,
    "asinh": jnp.sinh,
    "sqrt": lambda y: y * y,
    "rsqrt": lambda y: 1.0 / (y * y),
    "cbrt": lambda y: y * y * y,
    "copy": lambda y: y,
    "copy_p": lambda y: y,
    "erf_inv": lax.erf,
}


def _integer_pow(outs, ins, *, y, **params):
    (out,) = outs
    if y % 2 == 0 or y == 0:
        raise NotInvertibleError(f"x ** {y} is not invertible (even power)")
    if y < 0:
        out = 1.0 / out
    n = abs(y)
    if n == 1:
        return [out]
    return [jnp.sign(out) * jnp.abs(out) ** (1.0 / n)]


def _is_widening(src: Any, dst: Any) -> bool:
    """Whether every value of float dtype ``src`` is exactly a value of ``dst``."""
    if np.dtype(src) == np.dtype(dst):
        return True
    if jnp.issubdtype(src, jnp.complexfloating) != jnp.issubdtype(
        dst, jnp.complexfloating
    ):
        return False
    a, b = jnp.finfo(src), jnp.finfo(dst)
    return (
        b.nmant >= a.nmant
        and b.maxexp >= a.maxexp
        and b.minexp <= a.minexp
        and b.nexp >= a.nexp
    )


def _convert_element_type(outs, ins, *, new_dtype, in_avals, **params):
    a = in_avals[0]
    if not (
        jnp.issubdtype(a.dtype, jnp.inexact) and jnp.issubdtype(new_dtype, jnp.inexact)
    ):
        raise NotInvertibleError(
            f"conversion from {a.dtype} to {np.dtype(new_dtype)} is invertible only "
            "between floating types"
        )
    if not _is_widening(a.dtype, new_dtype):
        raise NotInvertibleError(
            f"conversion from {a.dtype} to {np.dtype(new_dtype)} rounds values "
            "(narrowing); only widening conversions can be undone"
        )
    return [lax.convert_element_type(outs[0], a.dtype)]


def _cumsum(outs, ins, *, axis, reverse=False, **params):
    (y,) = outs
    n = y.shape[axis]
    if n == 0:
        return [y]
    if reverse:
        shifted = lax.slice_in_dim(y, 1, n, axis=axis)
        pad = [(0, 0, 0)] * y.ndim
        pad[axis] = (0, 1, 0)
    else:
        shifted = lax.slice_in_dim(y, 0, n - 1, axis=axis)
        pad = [(0, 0, 0)] * y.ndim
        pad[axis] = (1, 0, 0)
    return [y - lax.pad(shifted, jnp.zeros((), y.dtype), pad)]


# --------------------------------------------------------------------------- #
# Shape and layout.


def _reshape(outs, ins, *, in_avals, **params):
    return [jnp.reshape(outs[0], in_avals[0].shape)]


def _transpose(outs, ins, *, permutation, **params):
    return [lax.transpose(outs[0], tuple(np.argsort(permutation)))]


def _broadcast_in_dim(outs, ins, *, shape, in_avals, **params):
    a = in_avals[0]
    if int(np.prod(a.shape)) != int(np.prod(shape)):
        raise NotInvertibleError(
            f"broadcast from {tuple(a.shape)} to {tuple(shape)} copies values; only "
            "broadcasts that add unit dimensions are invertible"
        )
    return [jnp.reshape(outs[0], a.shape)]


def _rev(outs, ins, *, dimensions, **params):
    return [lax.rev(outs[0], dimensions)]


def _concatenate(outs, ins, *, dimension, in_avals, **params):
    (y,) = outs
    new, start = list(ins), 0
    for i in range(len(ins)):
        size = in_avals[i].shape[dimension]
        if ins[i] is None:
            new[i] = lax.slice_in_dim(y, start, start + size, axis=dimension)
        start += size
    return new


def _split(outs, ins, *, axis, **params):
    return [lax.concatenate(list(outs), axis)]


LAYOUT = {
    "reshape": _reshape,
    "squeeze": _reshape,
    "expand_dims": _reshape,
    "transpose": _transpose,
    "broadcast_in_dim": _broadcast_in_dim,
    "rev": _rev,
    "concatenate": _concatenate,
    "split": _split,
}


# --------------------------------------------------------------------------- #
# Linear algebra: dot_general with a known square matrix, solved.


def _dot_general(outs, ins, *, dimension_numbers, in_avals, **params):
    (y,) = outs
    i = _one_unknown(ins)
    (lc, rc), (lb, rb) = dimension_numbers
    if lb or rb:
        raise NotInvertibleError("dot_general with batch dimensions is not supported")
    if len(lc) != 1:
        raise NotInvertibleError("dot_general must contract exactly one dimension")
    m = ins[1 - i]
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise NotInvertibleError(
            f"the known operand of dot_general must be a square matrix, got shape "
            f"{tuple(m.shape)}"
        )
    x_aval = in_avals[i]
    if not jnp.issubdtype(x_aval.dtype, jnp.inexact):
        raise NotInvertibleError("integer dot_general is not invertible")
    n = m.shape[0]
    cx = (lc if i == 0 else rc)[0]
    cm = (rc if i == 0 else lc)[0]
    if n == 0 or 0 in y.shape:  # nothing to solve for
        return _with(ins, i, jnp.zeros(x_aval.shape, x_aval.dtype))
    # Solve in at least float32 (LAPACK has no half-precision solvers).
    solve_dtype = jnp.promote_types(y.dtype, jnp.float32)
    y = y.astype(solve_dtype)
    mat = m.astype(solve_dtype)
    # Bring the product to the form  Y[..., j] = sum_k X[..., k] A[k, j].
    a = mat if cm == 0 else mat.T
    if i == 0:  # y dims: x free dims..., m free dim
        y2 = y
    else:  # y dims: m free dim, x free dims...
        y2 = jnp.moveaxis(y, 0, -1)
    batch_shape = y2.shape[:-1]
    flat = y2.reshape((-1, n))
    # X A = Y  <=>  A^T X^T = Y^T.
    x_flat = jnp.linalg.solve(a.T, flat.T).T
    x_moved = x_flat.reshape((*batch_shape, n)).astype(x_aval.dtype)
    return _with(ins, i, jnp.moveaxis(x_moved, -1, cx))


def _check_dot_general(statics, **params):
    for m in statics:
        if m is None:
            continue
        m = np.asarray(m, np.float64)
        if m.ndim == 2 and m.shape[0] == m.shape[1] and m.size:
            if np.linalg.matrix_rank(m) < m.shape[0]:
                raise NotInvertibleError(
                    "the constant matrix of dot_general is singular"
                )


# --------------------------------------------------------------------------- #
# Sharding and collectives. The engine gives every solved input its type's
# sharding (``revnet._engine.sharding.cast_like``): an Explicit sharding by a
# ``reshard``, varying axes by a ``pcast``, and an invariant value from a
# varying one by an exact all-reduce of one device's copy. So the inverse of
# an identity-like primitive is the identity on values. Collectives run inside
# ``shard_map`` bodies, whose rules are run per device (``_engine/shard_map``).


def _same_value(outs, ins, **params):
    """``sharding_constraint``, ``reshard``, ``mesh_cast``, ``pvary``: the value is
    unchanged, only its type; the engine casts it back to the input's type."""
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


SHARDING = {
    "sharding_constraint": _same_value,
    "reshard": _same_value,
    "mesh_cast": _same_value,  # the name of reshard's cousin in other JAX versions
    "pvary": _same_value,
    "ppermute": _ppermute,
    "all_gather": _all_gather,
    "all_to_all": _all_to_all,
}


# --------------------------------------------------------------------------- #
# The table: name -> (rule, trace-time check, elementwise).

TABLE: dict[str, tuple[InverseRuleFn, Callable[..., None] | None, bool]] = {
    **{name: (fn, check, True) for name, (fn, check) in ARITHMETIC.items()},
    **{name: (_unary(inv), None, True) for name, inv in UNARY.items()},
    "integer_pow": (_integer_pow, None, True),
    "convert_element_type": (_convert_element_type, None, True),
    "cumsum": (_cumsum, None, False),
    **{name: (fn, None, False) for name, fn in LAYOUT.items()},
    "dot_general": (_dot_general, _check_dot_general, False),
    **{name: (fn, None, False) for name, fn in SHARDING.items()},
}


def register_all() -> None:
    """Registers every rule of :data:`TABLE` in the engine's registry."""
    for name, (fn, check, elementwise) in TABLE.items():
        registry.register(name, fn, check, elementwise=elementwise)


register_all()
