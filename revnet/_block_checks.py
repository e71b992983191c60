"""Checks that the blocks of every front door make: the stream's shape, the
residual functions' outputs and the anchors' keyword arguments.

The generic argument checks they use live in :mod:`revnet._checks`.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from revnet._checks import check_bool, check_int, check_monitor
from revnet.invertible import invertible


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


def check_splittable(module: str, x: Any, expected: str, min_rank: int = 2) -> int:
    """Checks that the last axis of ``x`` splits into halves; returns its half."""
    check_input(module, x, min_rank=min_rank, expected=expected)
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


def check_anchors(module: str, anchor_every: Any, drift: Any) -> dict[str, Any]:
    """Checks ``anchor_every`` (None or a positive integer) and ``drift``.

    Returns:
      ``{"anchor_every": ..., "drift": ...}``, the keyword arguments of
      :func:`revnet._stack.run_stack` (``anchor_every`` as a Python int or
      None).

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


# The options every front door's ``ReversibleSequence`` takes and stores under
# these names, the keyword arguments of :func:`revnet._stack.run_stack`.
STACK_OPTIONS = ("reversible", "anchor_every", "drift", "decisions", "kinks")


def check_stack_options(
    module: str,
    *,
    reversible: Any,
    anchor_every: Any,
    drift: Any,
    decisions: Any,
    kinks: Any,
) -> dict[str, Any]:
    """Checks a sequence's :data:`STACK_OPTIONS`.

    Returns:
      The options by name, checked (see :func:`check_anchors`).

    Raises:
      TypeError: If ``reversible`` is not a bool, ``anchor_every`` not an
        integer or ``drift`` not a ``revnet.DriftMonitor``.
      ValueError: If ``anchor_every`` is not positive, or ``decisions`` or
        ``kinks`` is not one of its choices.
    """
    options = {"reversible": check_bool(module, "reversible", reversible)}
    options.update(check_anchors(module, anchor_every, drift))
    try:
        invertible(decisions=decisions, kinks=kinks)
    except ValueError as e:
        raise ValueError(f"{module}: {e}".replace("invertible: ", "")) from None
    return {**options, "decisions": decisions, "kinks": kinks}


def stack_options(sequence: Any) -> dict[str, Any]:
    """The :data:`STACK_OPTIONS` a sequence stored, for ``run_stack``."""
    return {name: getattr(sequence, name) for name in STACK_OPTIONS}
