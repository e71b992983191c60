"""Arithmetic: ``add``, ``sub``, ``neg``, ``mul``, ``div`` (with trace-time
checks refusing a constant zero factor), and their log-determinant terms:
zero for sums, ``log|k|`` for a factor ``k``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from revnet._engine import SMOOTH, InverseRuleFn, NotInvertibleError, define
from revnet.rules._solve import (
    check_not_broadcast,
    one_unknown,
    with_value,
)


def _binary(solve: Callable[[Any, Any, int], Any], what: str = "") -> InverseRuleFn:
    """A rule for ``y = a op b`` solving the one unknown operand.

    ``solve(y, known, i)`` returns operand ``i`` from the output and the other
    operand. With ``what``, integer operands are refused (``what`` names the
    operation in the message).
    """

    def rule(outs, ins, *, in_avals, **params):
        (y,) = outs
        i = one_unknown(ins)
        a = in_avals[i]
        check_not_broadcast(a.shape, y)
        if what and not jnp.issubdtype(a.dtype, jnp.inexact):
            raise NotInvertibleError(f"integer {what} is not invertible")
        return with_value(ins, i, solve(y, ins[1 - i], i))

    return rule


_add = _binary(lambda y, k, i: y - k)
_sub = _binary(lambda y, k, i: k - y if i == 1 else y + k)
_mul = _binary(lambda y, k, i: y / k, "multiplication")
_div = _binary(lambda y, k, i: y * k if i == 0 else k / y, "division")


def _neg(outs, ins, **params):
    return [-outs[0]]


# Log-determinant terms (see revnet._engine.registry): log|d y / d operand|.
def _log_abs(x: Any, shape: Any) -> Any:
    return jnp.broadcast_to(jnp.log(jnp.abs(x)), shape)


def _mul_term(outs, ins, unknown, **params):
    return _log_abs(ins[1 - unknown], jnp.shape(ins[unknown]))


def _div_term(outs, ins, unknown, **params):
    num, den = ins
    if unknown == 0:  # y = x / k
        return -_log_abs(den, jnp.shape(num))
    # y = k / x: |dy/dx| = |k| / x**2
    return _log_abs(num, jnp.shape(den)) - 2.0 * jnp.log(jnp.abs(den))


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


# Sums and products: smooth, elementwise; a product or quotient by a known
# factor k has the term log|k| (a constant zero factor is refused at trace time).
define("add", inverse=_add, continuity=SMOOTH, elementwise=True, log_det=0)
define("add_any", inverse=_add, continuity=SMOOTH, elementwise=True, log_det=0)
define("sub", inverse=_sub, continuity=SMOOTH, elementwise=True, log_det=0)
define("neg", inverse=_neg, continuity=SMOOTH, elementwise=True, log_det=0)
define(
    "mul",
    inverse=_mul,
    continuity=SMOOTH,
    check=_check_mul,
    elementwise=True,
    log_det=_mul_term,
)
define(
    "div",
    inverse=_div,
    continuity=SMOOTH,
    check=_check_div,
    elementwise=True,
    log_det=_div_term,
)
