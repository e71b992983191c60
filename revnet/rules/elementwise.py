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

from revnet._engine import (
    CAST,
    DECISION,
    SMOOTH,
    InverseRuleFn,
    NotInvertibleError,
    define,
    refusal,
)


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


def bijection(name: str, *, inverse: Callable[[Any], Any], log_det: Any) -> None:
    """Declares the elementwise bijection ``name``: smooth, elementwise,
    inverted by ``inverse(y)``, with the log-determinant term
    ``log_det(x, y) = log|f'(x)|`` (0 for an identity)."""
    term = 0 if isinstance(log_det, int) else unary_term(log_det)
    define(
        name, inverse=unary(inverse), continuity=SMOOTH, elementwise=True, log_det=term
    )


# log|f'(x)| in forms that stay finite where f' underflows:
# log(1 - tanh(x)**2) = 2 (log 2 - x - softplus(-2x)).
bijection("exp", inverse=jnp.log, log_det=lambda x, y: x)
bijection("log", inverse=jnp.exp, log_det=lambda x, y: -y)
bijection("exp2", inverse=jnp.log2, log_det=lambda x, y: x * _LOG2 + np.log(_LOG2))
# a primitive of its own from JAX 0.11 on (log, log, div before)
bijection("log2", inverse=jnp.exp2, log_det=lambda x, y: -jnp.log(x) - np.log(_LOG2))
bijection("log1p", inverse=jnp.expm1, log_det=lambda x, y: -y)
bijection("expm1", inverse=jnp.log1p, log_det=lambda x, y: x)
bijection(
    "tanh",
    inverse=jnp.arctanh,
    log_det=lambda x, y: 2.0 * (_LOG2 - x - jax.nn.softplus(-2.0 * x)),
)
bijection(
    "atanh", inverse=jnp.tanh, log_det=lambda x, y: -(jnp.log1p(x) + jnp.log1p(-x))
)
bijection(
    "logistic",
    inverse=_logit,
    log_det=lambda x, y: -jax.nn.softplus(x) - jax.nn.softplus(-x),
)
bijection(
    "sinh",
    inverse=jnp.arcsinh,
    log_det=lambda x, y: jnp.abs(x) + jnp.log1p(jnp.exp(-2.0 * jnp.abs(x))) - _LOG2,
)
bijection("asinh", inverse=jnp.sinh, log_det=lambda x, y: -0.5 * jnp.log1p(x * x))
bijection("sqrt", inverse=lambda y: y * y, log_det=lambda x, y: -_LOG2 - jnp.log(y))
bijection(
    "rsqrt",
    inverse=lambda y: 1.0 / (y * y),
    log_det=lambda x, y: 3.0 * jnp.log(y) - _LOG2,
)
bijection(
    "cbrt",
    inverse=lambda y: y * y * y,
    log_det=lambda x, y: -np.log(3.0) - 2.0 * jnp.log(jnp.abs(y)),
)
bijection("copy", inverse=lambda y: y, log_det=0)
bijection(
    "erf_inv", inverse=lax.erf, log_det=lambda x, y: 0.5 * np.log(np.pi) - _LOG2 + y * y
)


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


define(
    "integer_pow",
    inverse=integer_pow,
    continuity=SMOOTH,
    elementwise=True,
    log_det=integer_pow_term,
)
# A cast is a decision unless it widens (the continuity rule's special case).
define(
    "convert_element_type",
    inverse=convert_element_type,
    continuity=DECISION,
    elementwise=True,
    log_det=0,
)
define("cumsum", inverse=cumsum, continuity=SMOOTH, log_det=0)
