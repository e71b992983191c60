"""The carry handling shared by revnet.while_loop and revnet.scan.

The initial carry's promotion, the check of the carry the body returns, and
the names and forward-mode message that the loops' errors show. The loops'
arguments are checked in :mod:`revnet._checks`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from revnet._engine import aval


def avals(vars_: Any) -> list[Any]:
    return [aval(v) for v in vars_]


def describe(avals: Any) -> str:
    return ", ".join(f"{a.dtype}{list(a.shape)}" for a in avals)


def check_carry(
    fname: str, in_tree: Any, out_tree: Any, in_avals: list, out_avals: list
) -> None:
    """Raises TypeError unless the body returns a carry of the same type."""
    if in_tree != out_tree:
        raise TypeError(
            f"{fname} must return a carry with the same structure as its input: "
            f"got {out_tree}, expected {in_tree}"
        )
    for a, b in zip(in_avals, out_avals):
        if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
            raise TypeError(
                f"{fname} must return a carry with the same shapes and dtypes as its "
                f"input: got ({describe(out_avals)}), expected ({describe(in_avals)})"
            )


def name(fun: Any, default: str) -> str:
    """A function's name for messages, looking through ``functools.partial``."""
    while not hasattr(fun, "__name__") and hasattr(fun, "func"):
        fun = fun.func
    return getattr(fun, "__name__", default)


def promoted_carry(fun: Callable[..., Any], leaves: list, extra: list) -> list:
    """The initial carry's leaves as arrays, promoted as ``lax.scan`` does.

    ``lax.scan`` and ``lax.while_loop`` let a weakly typed leaf of the initial
    carry (a Python scalar such as ``0`` or ``1.0``) take the dtype that the
    body returns for it (``0`` becomes float32 when the body adds a float32 to
    it), and check the carry's type only after that promotion. A weak leaf
    whose dtype the body keeps stays weak (``lax.scan(f, 0, xs)`` with ``f``
    returning ``c + 1`` returns a weak int32): under
    ``jax.numpy_dtype_promotion("strict")`` the body may then add it to a
    float. This does the same, by one abstract evaluation of
    ``fun(*leaves, *extra)``, which returns the new carry's leaves, and only
    when a leaf is weak. When the body returns a carry with another number of
    leaves nothing is promoted: the carry check that follows reports it.
    """
    arrays = [jnp.asarray(x) for x in leaves]
    if any(getattr(a, "weak_type", False) for a in arrays):
        out = jax.eval_shape(fun, *arrays, *extra)
        if len(out) == len(arrays):
            arrays = [
                a
                if not getattr(a, "weak_type", False) or a.dtype == o.dtype
                else lax.convert_element_type(a, jax.dtypes.result_type(a, o))
                for a, o in zip(arrays, out)
            ]
    return arrays


def call(fname: str, run: Callable[..., Any], *args: Any) -> Any:
    """``run(*args)``, naming revnet's loop when forward mode reaches it."""
    try:
        return run(*args)
    except TypeError as e:
        if "forward-mode" not in str(e):
            raise
        raise TypeError(
            f"revnet.{fname} is differentiable in reverse mode only (jax.grad, "
            "jax.vjp, jax.jacrev, and jax.hessian, which is forward-over-reverse); "
            "forward mode (jax.jvp, jax.jacfwd) was applied to it"
        ) from None
