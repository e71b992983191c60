"""Argument checks and carry handling shared by revnet.while_loop and revnet.scan.

Every check raises a one-line ``TypeError`` or ``ValueError`` that names the
loop, the argument, the value given and what was expected.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from revnet._engine import aval, choose, revolve, show

INT32_MAX = int(np.iinfo(np.int32).max)


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


def check_callable(fname: str, arg: str, fun: Any) -> None:
    if not callable(fun):
        raise TypeError(f"{fname}: {arg} must be callable, got {show(fun)}")


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


_NON_NEGATIVE = "a non-negative integer known at trace time (a Python or NumPy integer)"


def integer(fname: str, arg: str, value: Any, minimum: int, expected: str, low: str):
    """``value`` as an int; a one-line TypeError unless it is an integer (a bool
    is not one), a ValueError (``must be {low}``) when below ``minimum``."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{fname}: {arg} must be {expected}, got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(
            f"{fname}: {arg} must be {expected}, got {show(value)}"
        ) from None
    if n < minimum:
        raise ValueError(f"{fname}: {arg} must be {low}, got {n}")
    return n


def check_max_steps(max_steps: Any) -> int | None:
    if max_steps is None:
        return None
    bound = integer(
        "while_loop", "max_steps", max_steps, 0, _NON_NEGATIVE, "non-negative"
    )
    if bound > INT32_MAX:
        raise ValueError(
            f"while_loop: max_steps must be at most {INT32_MAX}, got {bound}"
        )
    return bound


def positive_int(fname: str, arg: str, value: Any) -> int:
    """``value`` as an int, or a one-line error unless it is a positive integer."""
    expected = "a positive integer known at trace time, or None"
    return integer(fname, arg, value, 1, expected, "at least 1")


def check_checkpoints(fname: str, checkpoints: Any, bound: int | None) -> int:
    """The number of snapshots: ``checkpoints`` checked, or the default."""
    if checkpoints is None:
        return revolve.default_slots(bound)
    n = positive_int(fname, "checkpoints", checkpoints)
    # More snapshots than steps are never used.
    return n if bound is None else max(1, min(n, bound + 1))


def check_anchor_every(fname: str, anchor_every: Any) -> int | None:
    """``anchor_every`` checked: None or a positive integer."""
    if anchor_every is None:
        return None
    return positive_int(fname, "anchor_every", anchor_every)


class Default(str):
    """The default of ``mode=`` (``"auto"``), told apart from ``"auto"`` given."""


AUTO = Default(choose.AUTO)

# A sentinel: ``invert=`` was not given.
UNSET: Any = object()

_FROM_INVERT = {None: choose.AUTO, True: choose.INVERT, False: choose.CHECKPOINT}


def check_mode(fname: str, mode: Any, invert: Any) -> str:
    """The backward mode from ``mode=`` and the deprecated ``invert=``.

    Raises:
      TypeError: when both are given, or ``invert`` is not None or a bool.
      ValueError: when ``mode`` is not one of the four modes.
    """
    if invert is not UNSET:
        if mode is not AUTO:
            raise TypeError(
                f"{fname}: got both invert= and mode=; invert= is deprecated, "
                "give mode= only"
            )
        if not (invert is None or isinstance(invert, (bool, np.bool_))):
            raise TypeError(
                f"{fname}: invert must be None (automatic), True or False, got "
                f"{show(invert)}"
            )
        mode = _FROM_INVERT[None if invert is None else bool(invert)]
        warnings.warn(
            f"{fname}: invert={invert!r} is deprecated; use mode={mode!r}",
            DeprecationWarning,
            stacklevel=3,
        )
    if not isinstance(mode, str) or mode not in choose.MODES:
        raise ValueError(
            f"{fname}: mode must be one of {', '.join(map(repr, choose.MODES))}, "
            f"got {show(mode)}"
        )
    return str(mode)


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


def check_length(length: Any) -> int | None:
    if length is None:
        return None
    return integer("scan", "length", length, 0, _NON_NEGATIVE, "non-negative")


def check_reverse(reverse: Any) -> bool:
    if not isinstance(reverse, (bool, np.bool_)):
        raise TypeError(
            "scan: reverse must be a bool known at trace time (True or False), got "
            f"{show(reverse)}"
        )
    return bool(reverse)


def check_unroll(unroll: Any) -> int | bool:
    """``unroll`` as ``lax.scan`` takes it: a bool or a non-negative int."""
    expected = "a bool or a non-negative integer known at trace time"
    if isinstance(unroll, (bool, np.bool_)):
        return bool(unroll)
    try:
        u = operator.index(unroll)
    except TypeError:
        raise TypeError(
            f"scan: unroll must be {expected}, got {show(unroll)}"
        ) from None
    if u < 0:
        raise ValueError(f"scan: unroll must be {expected}, got {u}")
    return u


def scan_length(xs_leaves: list, length: int | None) -> int:
    if any(np.ndim(x) == 0 for x in xs_leaves):
        raise ValueError(
            "scan got a scalar in xs; every leaf of xs needs a leading "
            "axis to scan over"
        )
    lengths = {int(np.shape(x)[0]) for x in xs_leaves}
    if length is not None:
        lengths.add(length)
    if len(lengths) > 1:
        raise ValueError(
            "scan got inconsistent lengths: the leading axes of xs and length give "
            f"{sorted(lengths)}"
        )
    if not lengths:
        raise ValueError("scan needs xs with a leading axis or an explicit length")
    return lengths.pop()
