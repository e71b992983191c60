"""Checks that the blocks of every front door make: the stream's shape, the
residual functions' outputs, a sequence's blocks and a transformer's sizes.

The generic argument checks they use live in :mod:`revnet._checks`; the
options of a stack are checked where they are made, in
:mod:`revnet._layers.options`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from revnet._checks import check_callable, check_int, check_real, fail
from revnet._engine import show


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


def check_blocks(
    module: str,
    arg: str,
    blocks: Any,
    num_layers: Any,
    *,
    anchored: bool,
) -> tuple[tuple[Any, ...], int, bool]:
    """Checks a sequence's blocks: one block stacked ``num_layers`` times, or
    a list of different blocks run one after another.

    Args:
      module: Name of the module, for error messages.
      arg: Name of the blocks' argument (``"block_fn"``, ``"block"``, ...).
      blocks: A callable, or a non-empty list of callables.
      num_layers: The number of copies of a single block; None with a list.
      anchored: Whether ``anchor_every`` or ``drift`` was given, which need
        a single block.

    Returns:
      ``(blocks, num_layers, stacked)``: the blocks as a tuple (one entry for
      a stacked block), the number of layers and whether they are stacked.

    Raises:
      TypeError: If ``blocks`` is neither a callable nor a list of callables,
        or ``num_layers`` is not an integer.
      ValueError: If ``num_layers`` is missing with one block or given with a
        list, the list is empty, or anchors are asked of a list.
    """
    if callable(blocks):
        if num_layers is None:
            raise ValueError(
                f"{module}: num_layers must be a positive integer with a single "
                f"{arg}, got None."
            )
        return (blocks,), check_int(module, "num_layers", num_layers), True
    if anchored:
        raise ValueError(
            f"{module}: anchor_every and drift need a single {arg} stacked "
            "num_layers times; a list of blocks is unrolled and has no anchors."
        )
    expected = "a callable or a non-empty list of callables"
    if isinstance(blocks, (str, bytes)) or not isinstance(blocks, Sequence):
        raise fail(module, arg, blocks, expected)
    listed = tuple(blocks)
    for i, block in enumerate(listed):
        check_callable(module, f"{arg}[{i}]", block)
    if num_layers is not None or not listed:
        raise ValueError(
            f"{module}: with a list of blocks leave out num_layers and give at "
            f"least one block, got {len(listed)} blocks and "
            f"num_layers={show(num_layers)}."
        )
    return listed, len(listed), False


def check_transformer(
    module: str, model_size: Any, num_heads: Any, mlp_size: Any, dropout_rate: Any
) -> tuple[int, int, int, float]:
    """Checks a reversible transformer block's sizes and dropout rate.

    Returns:
      ``(model_size, num_heads, mlp_size, dropout_rate)``, checked.

    Raises:
      TypeError: If a size is not an integer or the rate not a number.
      ValueError: If a size is not positive, the rate not in ``[0, 1)``, or
        ``model_size`` is odd or its halves are not divisible by
        ``num_heads``.
    """
    model_size = check_int(module, "model_size", model_size)
    num_heads = check_int(module, "num_heads", num_heads)
    mlp_size = check_int(module, "mlp_size", mlp_size)
    rate = check_real(
        module, "dropout_rate", dropout_rate, "a number in [0, 1)", 0.0, 1.0
    )
    if model_size % 2 or (model_size // 2) % num_heads:
        raise ValueError(
            f"{module}: model_size must be even and model_size // 2 divisible by "
            f"num_heads, got model_size={model_size}, num_heads={num_heads}."
        )
    return model_size, num_heads, mlp_size, rate


def check_width(module: str, x: Any, rank: int, expected: str, hint: str = "") -> None:
    """Checks that ``x`` has ``rank`` and the last axis of ``expected``, a
    shape such as ``"[batch, time, 16]"``; ``hint`` ends the message."""
    check_input(module, x, rank=rank, expected=expected + hint)
    width = int(expected.rstrip("]").rsplit(",", 1)[-1])
    if x.shape[-1] != width:
        raise ValueError(
            f"{module}: expected an input of shape {expected}{hint}, got "
            f"{tuple(x.shape)}."
        )
