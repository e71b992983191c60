"""The methods every batch-level flow layer shares (Haiku's and NNX's).

A layer defines ``_forward(x)``, which fetches (or creates) its parameters
and returns the pure map ``h -> y``; the call, the log-determinant derived
from that map's program and the inverse follow from it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from revnet._forward_and_log_det import derive
from revnet._layers.couplings import invert
from revnet._layers.stack import PER_EXAMPLE


class FlowMethods:
    """``__call__``, ``forward_and_log_det`` and ``inverse`` from ``_forward``."""

    def _forward(self, x: Any) -> Callable[[jax.Array], jax.Array]:
        raise NotImplementedError

    def __call__(self, x: jax.Array) -> jax.Array:
        """Applies the layer to ``x`` of shape ``[batch, ..., channels]``."""
        return self._forward(x)(x)

    def forward_and_log_det(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Applies the layer; returns ``(y, log_det)``, ``log_det`` of shape
        ``[batch]`` derived from the program."""
        return derive(self._forward(x), (x,), (), 1, PER_EXAMPLE)

    def inverse(self, y: jax.Array) -> jax.Array:
        """Rebuilds the input from the output ``y``."""
        return invert(self._forward(y), y)
