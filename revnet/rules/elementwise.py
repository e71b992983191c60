"""Elementwise bijections (``exp``, ``log``, ``tanh``, ``erf_inv``, ...),
``integer_pow`` with an odd power, widening ``convert_element_type``, and
``cumsum``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from revnet._engine import CAST, InverseRuleFn, NotInvertibleError, refusal


def unary(inverse: Callable[[Any], Any]) -> InverseRuleFn:
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
    "erf_inv": lax.erf,
}


def integer_pow(outs, ins, *, y, **params):
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


def convert_element_type(outs, ins, *, new_dtype, in_avals, **params):
    a = in_avals[0]
    if not (
        jnp.issubdtype(a.dtype, jnp.inexact) and jnp.issubdtype(new_dtype, jnp.inexact)
    ):
        raise refusal(
            f"conversion from {a.dtype} to {np.dtype(new_dtype)} is invertible only "
            "between floating types",
            hint=CAST,
        )
    if not _is_widening(a.dtype, new_dtype):
        raise refusal(
            f"conversion from {a.dtype} to {np.dtype(new_dtype)} rounds values "
            "(narrowing); only widening conversions can be undone",
            hint=CAST,
        )
    return [lax.convert_element_type(outs[0], a.dtype)]


def cumsum(outs, ins, *, axis, reverse=False, **params):
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
