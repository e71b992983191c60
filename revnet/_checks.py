"""Argument checks of revnet's front ends (the loops' options use them in
:mod:`revnet._loop_options`, the blocks' in :mod:`revnet._block_checks`).

Every check raises a one-line ``TypeError`` (wrong kind of value) or
``ValueError`` (right kind, wrong value) written by :func:`fail`: it names
where the argument was given (a loop or a module), the argument, the value
given and what was expected.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from revnet._engine import show
from revnet.drift import DriftMonitor

_BOOLS = (bool, np.bool_)


def fail(
    where: str, arg: str, value: Any, expected: str, error: type = TypeError
) -> Exception:
    """The one-line error ``"{where}: {arg} must be {expected}, got {value}"``."""
    return error(f"{where}: {arg} must be {expected}, got {show(value)}")


def one_of(choices: tuple[Any, ...]) -> str:
    """``choices`` for a message: ``'a' or 'b'``, ``one of 'a', 'b', 'c'``."""
    shown = [repr(c) for c in choices]
    return " or ".join(shown) if len(shown) < 3 else f"one of {', '.join(shown)}"


# --------------------------------------------------------------------------- #
# Generic validators.


def check_int(
    where: str,
    arg: str,
    value: Any,
    minimum: int = 1,
    expected: str | None = None,
    low: str | None = None,
) -> int:
    """Checks that ``value`` is an integer (not a bool) of at least ``minimum``.

    Python and NumPy integers, and anything else with ``__index__``, are
    accepted; a traced value is not.

    Args:
      where: The loop or module, for the message.
      arg: The argument's name.
      value: The value given.
      minimum: The smallest value allowed.
      expected: What a value of the wrong type is told it must be; by default
        ``"a positive integer"`` (``minimum`` 1), ``"a non-negative integer"``
        (0) or ``"an integer of at least {minimum}"``.
      low: What a value below ``minimum`` is told it must be; by default
        ``expected``.

    Returns:
      ``value`` as a Python int.

    Raises:
      TypeError: If ``value`` is not an integer (a bool, a float, a string).
      ValueError: If ``value`` is smaller than ``minimum``.
    """
    if expected is None:
        expected = {0: "a non-negative integer", 1: "a positive integer"}.get(
            minimum, f"an integer of at least {minimum}"
        )
    if isinstance(value, _BOOLS):
        raise fail(where, arg, value, expected)
    try:
        n = operator.index(value)
    except TypeError:
        raise fail(where, arg, value, expected) from None
    if n < minimum:
        raise fail(where, arg, n, low or expected, ValueError)
    return n


def check_real(
    where: str,
    arg: str,
    value: Any,
    expected: str,
    low: float | None = None,
    high: float | None = None,
    low_inclusive: bool = True,
) -> float:
    """Checks that ``value`` is a finite real number (not a bool) in a range.

    ``low`` is inclusive unless ``low_inclusive`` is False; ``high`` is
    exclusive.

    Returns:
      ``value`` as a Python float.

    Raises:
      TypeError: If ``value`` is not a real number.
      ValueError: If ``value`` is not finite or outside the range.
    """
    if not isinstance(value, numbers.Real) or isinstance(value, _BOOLS):
        raise fail(where, arg, value, expected)
    v = float(value)
    below = low is not None and (v < low if low_inclusive else v <= low)
    if not math.isfinite(v) or below or (high is not None and v >= high):
        raise fail(where, arg, value, expected, ValueError)
    return v


def check_bool(
    where: str, arg: str, value: Any, expected: str = "a bool (True or False)"
) -> bool:
    """Checks that ``value`` is a Python or NumPy bool; returns it as a bool.

    Raises:
      TypeError: If ``value`` is not a bool (``0``, ``"yes"`` and None are not).
    """
    if not isinstance(value, _BOOLS):
        raise fail(where, arg, value, expected)
    return bool(value)


def check_callable(where: str, arg: str, value: Any) -> Any:
    """Checks that ``value`` is callable; returns it.

    Raises:
      TypeError: If ``value`` is not callable.
    """
    if not callable(value):
        raise fail(where, arg, value, "callable")
    return value


def check_choice(where: str, arg: str, value: Any, choices: tuple[str, ...]) -> str:
    """Checks that ``value`` is one of the strings ``choices``; returns it.

    Raises:
      TypeError: If ``value`` is not a string.
      ValueError: If ``value`` is not one of ``choices``.
    """
    if not isinstance(value, str):
        raise fail(where, arg, value, one_of(choices))
    if value not in choices:
        raise fail(where, arg, value, one_of(choices), ValueError)
    return value


def check_float_dtype(where: str, arg: str, value: Any) -> Any:
    """Checks that ``value`` is None or a floating point dtype.

    Returns:
      None, or ``value`` as a NumPy dtype (``jnp.bfloat16`` and ``"float16"``
      are accepted).

    Raises:
      TypeError: If ``value`` is not a dtype, or not a floating point one.
    """
    if value is None:
        return None
    expected = "None or a floating point dtype (such as jnp.bfloat16)"
    if isinstance(value, (*_BOOLS, numbers.Number)):
        raise fail(where, arg, value, expected)
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        raise fail(where, arg, value, expected) from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise fail(where, arg, value, expected)
    return dtype


def check_mapping(where: str, arg: str, value: Any) -> dict | None:
    """Checks that ``value`` is None or a mapping with string keys.

    Returns:
      None, or ``value`` as a dict.

    Raises:
      TypeError: If ``value`` is not a mapping of keyword arguments.
    """
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise fail(where, arg, value, "None or a dict of keyword arguments")
    return dict(value)


def check_monitor(where: str, arg: str, value: Any) -> DriftMonitor | None:
    """Checks that ``value`` is a :class:`revnet.DriftMonitor` or None.

    Raises:
      TypeError: If it is anything else.
    """
    if value is not None and not isinstance(value, DriftMonitor):
        raise fail(where, arg, value, "a revnet.DriftMonitor or None")
    return value


def check_sharding(where: str, arg: str, value: Any) -> Any:
    """Checks that ``value`` is None, a ``PartitionSpec`` or a ``NamedSharding``.

    Raises:
      TypeError: If it is anything else (a tuple of axis names is not taken
        for a spec: wrap it in ``jax.sharding.PartitionSpec``).
    """
    if value is not None and not isinstance(
        value, (jax.sharding.PartitionSpec, jax.sharding.NamedSharding)
    ):
        expected = "None, a jax.sharding.PartitionSpec or a jax.sharding.NamedSharding"
        raise fail(where, arg, value, expected)
    return value
