"""Argument checks of revnet's front ends: the loops and the Haiku blocks.

Every check raises a one-line ``TypeError`` (wrong kind of value) or
``ValueError`` (right kind, wrong value) written by :func:`fail`: it names
where the argument was given (a loop or a module), the argument, the value
given and what was expected.
"""

from __future__ import annotations

import math
import numbers
import operator
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from revnet._engine import INT32_MAX, check_options, choose, revolve, show
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


# --------------------------------------------------------------------------- #
# The options of revnet.while_loop and revnet.scan.

_NON_NEGATIVE = "a non-negative integer known at trace time (a Python or NumPy integer)"
_POSITIVE = "a positive integer known at trace time, or None"


class Default(str):
    """The default of ``mode=`` (``"auto"``), told apart from ``"auto"`` given."""


AUTO = Default(choose.AUTO)

# A sentinel: ``invert=`` was not given.
UNSET: Any = object()

_FROM_INVERT = {None: choose.AUTO, True: choose.INVERT, False: choose.CHECKPOINT}


def _positive(where: str, arg: str, value: Any) -> int | None:
    """None, or ``value`` checked to be a positive integer."""
    if value is None:
        return None
    return check_int(where, arg, value, 1, _POSITIVE, "at least 1")


def _non_negative(where: str, arg: str, value: Any) -> int | None:
    """None, or ``value`` checked to be a non-negative integer."""
    if value is None:
        return None
    return check_int(where, arg, value, 0, _NON_NEGATIVE, "non-negative")


def check_checkpoints(where: str, checkpoints: Any, bound: int | None) -> int:
    """The number of snapshots: ``checkpoints`` checked, or the default."""
    if checkpoints is None:
        return revolve.default_slots(bound)
    n = _positive(where, "checkpoints", checkpoints)
    # More snapshots than steps are never used.
    return n if bound is None else max(1, min(n, bound + 1))


def _mode(where: str, mode: Any, invert: Any) -> str:
    """The backward mode from ``mode=`` and the deprecated ``invert=``.

    Raises:
      TypeError: when both are given, or ``invert`` is not None or a bool.
      ValueError: when ``mode`` is not one of the four modes.
    """
    if invert is not UNSET:
        if mode is not AUTO:
            raise TypeError(
                f"{where}: got both invert= and mode=; invert= is deprecated, "
                "give mode= only"
            )
        if not (invert is None or isinstance(invert, _BOOLS)):
            raise fail(where, "invert", invert, "None (automatic), True or False")
        mode = _FROM_INVERT[None if invert is None else bool(invert)]
        warnings.warn(
            f"{where}: invert={invert!r} is deprecated; use mode={mode!r}",
            DeprecationWarning,
            stacklevel=4,
        )
    if not isinstance(mode, str) or mode not in choose.MODES:
        raise fail(where, "mode", mode, one_of(choose.MODES), ValueError)
    return str(mode)


def while_options(
    cond_fun: Any,
    body_fun: Any,
    max_steps: Any,
    checkpoints: Any,
    mode: Any,
    invert: Any,
    anchor_every: Any,
    drift: Any,
    decisions: Any,
    kinks: Any,
) -> tuple[int | None, int, str, int | None, DriftMonitor | None]:
    """The options of ``revnet.while_loop`` checked.

    Returns:
      ``(bound, slots, mode, anchor_every, drift)``: ``max_steps`` as an int
      or None, the number of snapshots, the backward mode, and the anchor
      interval (the whole loop when only ``drift`` asks for anchors).
    """
    check_options(decisions, kinks, "while_loop")
    check_callable("while_loop", "cond_fun", cond_fun)
    check_callable("while_loop", "body_fun", body_fun)
    bound = _non_negative("while_loop", "max_steps", max_steps)
    if bound is not None and bound > INT32_MAX:
        raise fail("while_loop", "max_steps", bound, f"at most {INT32_MAX}", ValueError)
    slots = check_checkpoints("while_loop", checkpoints, bound)
    mode = _mode("while_loop", mode, invert)
    if mode == "store" and bound is None:
        raise ValueError(
            "while_loop: mode='store' stores carry leaves at every step and needs "
            "max_steps (room for that many steps); give max_steps, or use "
            "mode='checkpoint'"
        )
    anchor_every = _positive("while_loop", "anchor_every", anchor_every)
    drift = check_monitor("while_loop", "drift", drift)
    if anchor_every is not None and bound is None:
        raise ValueError(
            "while_loop: anchor_every needs max_steps (room for the anchors is "
            f"made for max_steps steps), got anchor_every={anchor_every} and "
            "max_steps=None"
        )
    if drift is not None and anchor_every is None:
        anchor_every = INT32_MAX if bound is None else max(bound, 1)
    return bound, slots, mode, anchor_every, drift


def scan_options(
    f: Any,
    length: Any,
    reverse: Any,
    unroll: Any,
    mode: Any,
    invert: Any,
    anchor_every: Any,
    drift: Any,
    decisions: Any,
    kinks: Any,
) -> tuple[int | None, bool, int | bool, str, int | None, DriftMonitor | None]:
    """The options of ``revnet.scan`` checked, all but ``checkpoints``.

    ``checkpoints`` needs the number of steps: :func:`check_checkpoints`.

    Returns:
      ``(length, reverse, unroll, mode, anchor_every, drift)``; ``unroll`` as
      ``lax.scan`` takes it, a bool or a non-negative int.
    """
    check_options(decisions, kinks, "scan")
    check_callable("scan", "f", f)
    length = _non_negative("scan", "length", length)
    reverse = check_bool(
        "scan", "reverse", reverse, "a bool known at trace time (True or False)"
    )
    if isinstance(unroll, _BOOLS):
        unroll = bool(unroll)
    else:
        expected = "a bool or a non-negative integer known at trace time"
        unroll = check_int("scan", "unroll", unroll, 0, expected)
    mode = _mode("scan", mode, invert)
    anchor_every = _positive("scan", "anchor_every", anchor_every)
    drift = check_monitor("scan", "drift", drift)
    return length, reverse, unroll, mode, anchor_every, drift


def scan_length(xs_leaves: list, length: int | None) -> int:
    """The number of steps, from the leading axes of ``xs`` and ``length``."""
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
