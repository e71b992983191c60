"""Elementwise bijections (``exp``, ``log``, ``tanh``, ``erf_inv``, ...),
``integer_pow`` with an odd power, widening ``convert_element_type``, and
``cumsum``, with their log-determinant terms (``log|f'(x)|``; zero for the
cast and for ``cumsum``, whose Jacobian is unit triangular)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from revnet._engine import CAST, InverseRuleFn, NotInvertibleError, refusal


def unary(inverse: Callable[[Any], Any]) -> InverseRuleFn:
    def rule(outs, ins, **params):
        return [inverse(outs[0])]

    return rule


def unary_term(term: Callable[[Any, Any], Any]) -> Callable[..., Any]:
    """The log-determinant term ``term(x, y)`` of ``y = f(x)``: log|f'(x)|."""

    def log_det(outs, ins, unknown, **params):
        return term(ins[0], outs[0])

    return log_det


def _logit(y):
    return jnp.log(y) - jnp.log1p(-y)


_LOG2 = float(np.log(2.0))

# name -> (inverse, log|f'(x)| as a function of (x, y)), in forms that stay
# finite where f' underflows: log(1 - tanh(x)**2) = 2 (log 2 - x - softplus(-2x)).
UNARY = {
    "exp": (jnp.log, lambda x, y: x),
    "log": (jnp.exp, lambda x, y: -y),
    "exp2": (jnp.log2, lambda x, y: x * _LOG2 + np.log(_LOG2)),
    # a primitive of its own from JAX 0.11 on (log, log, div before)
    "log2": (jnp.exp2, lambda x, y: -jnp.log(x) - np.log(_LOG2)),
    "log1p": (jnp.expm1, lambda x, y: -y),
    "expm1": (jnp.log1p, lambda x, y: x),
    "tanh": (
        jnp.arctanh,
        lambda x, y: 2.0 * (_LOG2 - x - jax.nn.softplus(-2.0 * x)),
    ),
    "atanh": (jnp.tanh, lambda x, y: -(jnp.log1p(x) + jnp.log1p(-x))),
    "logistic": (_logit, lambda x, y: -jax.nn.softplus(x) - jax.nn.softplus(-x)),
    "sinh": (
        jnp.arcsinh,
        lambda x, y: jnp.abs(x) + jnp.log1p(jnp.exp(-2.0 * jnp.abs(x))) - _LOG2,
    ),
    "asinh": (jnp.sinh, lambda x, y: -0.5 * jnp.log1p(x * x)),
    "sqrt": (lambda y: y * y, lambda x, y: -_LOG2 - jnp.log(y)),
    "rsqrt": (lambda y: 1.0 / (y * y), lambda x, y: 3.0 * jnp.log(y) - _LOG2),
    "cbrt": (
        lambda y: y * y * y,
        lambda x, y: -np.log(3.0) - 2.0 * jnp.log(jnp.abs(y)),
    ),
    "copy": (lambda y: y, 0),
    "erf_inv": (lax.erf, lambda x, y: 0.5 * np.log(np.pi) - _LOG2 + y * y),
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


def integer_pow_term(outs, ins, unknown, *, y, **params):
    """log|n x**(n-1)| of ``x ** n``."""
    if y == 1:
        return jnp.zeros_like(ins[0])
    return np.log(abs(y)) + (y - 1) * jnp.log(jnp.abs(ins[0]))


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
