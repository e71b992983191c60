"""Input validation shared by the blocks, with errors that name the module."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from revnet._engine import show
from revnet.drift import DriftMonitor


def check_input(
    module: str,
    x: Any,
    *,
    rank: int | None = None,
    min_rank: int | None = None,
    expected: str,
) -> None:
    """Checks that ``x`` is a floating point array of a suitable rank.

    Args:
      module: Name of the module, for the error message.
      x: The input (an array or a recording placeholder).
      rank: Required rank, if any.
      min_rank: Required minimum rank, if any.
      expected: Human-readable expected shape, e.g. ``"[batch, ..., channels]"``.

    Raises:
      TypeError: If ``x`` has no shape, or is not floating point.
      ValueError: If ``x`` has the wrong rank.
    """
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(
            f"{module}: expected an array of shape {expected}, got {type(x).__name__}."
        )
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"{module}: expected a floating point input of shape {expected}, got "
            f"dtype {x.dtype}."
        )
    ndim = len(x.shape)
    if (rank is not None and ndim != rank) or (
        min_rank is not None and ndim < min_rank
    ):
        raise ValueError(
            f"{module}: expected an input of shape {expected}, got shape "
            f"{tuple(x.shape)} (rank {ndim})."
        )


def check_splittable(module: str, x: Any, expected: str) -> int:
    """Checks that the last axis of ``x`` splits into halves; returns its half."""
    check_input(module, x, min_rank=2, expected=expected)
    channels = x.shape[-1]
    if channels % 2:
        raise ValueError(
            f"{module}: the last axis is split into two halves, so it must be even; "
            f"expected shape {expected}, got {tuple(x.shape)}."
        )
    return channels // 2


def check_output(module: str, what: str, out: Any, shape: tuple[int, ...]) -> None:
    """Checks that a residual function returned an array of ``shape``."""
    if tuple(jnp.shape(out)) != tuple(shape):
        raise ValueError(
            f"{module}: {what} must return an array of shape {tuple(shape)}, got "
            f"{tuple(jnp.shape(out))}."
        )


# --------------------------------------------------------------------------- #
# Constructor arguments: checked up front, one-line errors that name the module,
# the argument, the value and what was expected.


def _fail(
    module: str, arg: str, value: Any, expected: str, error: type = TypeError
) -> Exception:
    return error(f"{module}: {arg} must be {expected}, got {show(value)}.")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(
        value, (bool, np.bool_)
    )


def check_name(cls: type, name: Any) -> None:
    """Checks a module's ``name`` before ``hk.Module.__init__`` sees it.

    Haiku itself rejects strings that are not identifiers; anything that is not
    a string fails inside Haiku with an unrelated message.

    Raises:
      TypeError: If ``name`` is neither a string nor None.
    """
    if name is not None and not isinstance(name, str):
        raise _fail(cls.__name__, "name", name, "a string or None")


def check_int(module: str, arg: str, value: Any, minimum: int = 1) -> int:
    """Checks that ``value`` is an integer (not a bool) of at least ``minimum``.

    Python and NumPy integers are accepted.

    Returns:
      ``value`` as a Python int.

    Raises:
      TypeError: If ``value`` is not an integer (a bool, a float, a string).
      ValueError: If ``value`` is smaller than ``minimum``.
    """
    expected = {0: "a non-negative integer", 1: "a positive integer"}.get(
        minimum, f"an integer of at least {minimum}"
    )
    if not _is_int(value):
        raise _fail(module, arg, value, expected)
    if value < minimum:
        raise _fail(module, arg, value, expected, ValueError)
    return int(value)


def check_real(
    module: str,
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
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)):
        raise _fail(module, arg, value, expected)
    v = float(value)
    below = low is not None and (v < low if low_inclusive else v <= low)
    if not math.isfinite(v) or below or (high is not None and v >= high):
        raise _fail(module, arg, value, expected, ValueError)
    return v


def check_bool(module: str, arg: str, value: Any) -> bool:
    """Checks that ``value`` is a Python or NumPy bool; returns it as a bool.

    Raises:
      TypeError: If ``value`` is not a bool (``0``, ``"yes"`` and None are not).
    """
    if not isinstance(value, (bool, np.bool_)):
        raise _fail(module, arg, value, "a bool (True or False)")
    return bool(value)


def check_callable(module: str, arg: str, value: Any, expected: str = "") -> Any:
    """Checks that ``value`` is callable; returns it.

    Raises:
      TypeError: If ``value`` is not callable.
    """
    if not callable(value):
        raise _fail(module, arg, value, expected or "a callable")
    return value


def check_choice(module: str, arg: str, value: Any, choices: tuple[str, ...]) -> str:
    """Checks that ``value`` is one of the strings ``choices``; returns it.

    Raises:
      TypeError: If ``value`` is not a string.
      ValueError: If ``value`` is not one of ``choices``.
    """
    expected = " or ".join(repr(c) for c in choices)
    if not isinstance(value, str):
        raise _fail(module, arg, value, expected)
    if value not in choices:
        raise _fail(module, arg, value, expected, ValueError)
    return value


def check_float_dtype(module: str, arg: str, value: Any) -> Any:
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
    if isinstance(value, (bool, np.bool_, numbers.Number)):
        raise _fail(module, arg, value, expected)
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        raise _fail(module, arg, value, expected) from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise _fail(module, arg, value, expected)
    return dtype


def check_mapping(module: str, arg: str, value: Any) -> dict | None:
    """Checks that ``value`` is None or a mapping with string keys.

    Returns:
      None, or ``value`` as a dict.

    Raises:
      TypeError: If ``value`` is not a mapping of keyword arguments.
    """
    if value is None:
        return None
    expected = "None or a dict of keyword arguments"
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise _fail(module, arg, value, expected)
    return dict(value)


def check_monitor(module: str, arg: str, value: Any) -> Any:
    """Checks that ``value`` is a :class:`revnet.DriftMonitor` or None.

    Raises:
      TypeError: If it is anything else.
    """
    if value is not None and not isinstance(value, DriftMonitor):
        raise _fail(module, arg, value, "a revnet.DriftMonitor or None")
    return value


def check_anchors(module: str, anchor_every: Any, drift: Any) -> dict[str, Any]:
    """Checks ``anchor_every`` (None or a positive integer) and ``drift``.

    Returns:
      ``{"anchor_every": ..., "drift": ...}``, the keyword arguments of
      :class:`~revnet.blocks.ReversibleSequence` (``anchor_every`` as a
      Python int or None).

    Raises:
      TypeError: If ``anchor_every`` is not an integer or ``drift`` not a
        ``revnet.DriftMonitor``.
      ValueError: If ``anchor_every`` is not positive.
    """
    if anchor_every is not None:
        anchor_every = check_int(module, "anchor_every", anchor_every)
    return {
        "anchor_every": anchor_every,
        "drift": check_monitor(module, "drift", drift),
    }


def check_sharding(module: str, arg: str, value: Any) -> Any:
    """Checks that ``value`` is None, a ``PartitionSpec`` or a ``NamedSharding``.

    Returns:
      ``value``.

    Raises:
      TypeError: If it is anything else (a tuple of axis names is not taken
        for a spec: wrap it in ``jax.sharding.PartitionSpec``).
    """
    if value is not None and not isinstance(
        value, (jax.sharding.PartitionSpec, jax.sharding.NamedSharding)
    ):
        raise _fail(
            module,
            arg,
            value,
            "None, a jax.sharding.PartitionSpec or a jax.sharding.NamedSharding",
        )
    return value
