"""Helpers shared by the built-in rules: finding and filling the unknown input."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from revnet._engine import NotInvertibleError


def unknown(ins: Sequence[Any]) -> list[int]:
    """The positions of the unknown (None) inputs."""
    return [i for i, v in enumerate(ins) if v is None]


def one_unknown(ins: Sequence[Any], what: str = "operand") -> int:
    """The position of the one unknown input.

    Raises:
      NotInvertibleError: if not exactly one input is unknown.
    """
    idx = unknown(ins)
    if len(idx) != 1:
        raise NotInvertibleError(
            f"{len(idx)} {what}s are unknown; an equation can be solved for one"
        )
    return idx[0]


def check_not_broadcast(unknown_shape: Sequence[int], out: Any) -> None:
    """Refuses an unknown operand that was broadcast to the output's shape.

    Raises:
      NotInvertibleError: if the shapes differ.
    """
    if tuple(unknown_shape) != tuple(out.shape):
        raise NotInvertibleError(
            f"the unknown operand of shape {tuple(unknown_shape)} was broadcast to "
            f"{tuple(out.shape)}"
        )


def with_value(ins: Sequence[Any], i: int, value: Any) -> list[Any]:
    """``ins`` with input ``i`` replaced by ``value``."""
    out = list(ins)
    out[i] = value
    return out
