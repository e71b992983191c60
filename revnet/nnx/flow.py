"""Flow layers as NNX modules: ``ActNorm``, ``InvertibleConv1x1``, ``Squeeze``.

Each acts on ``[batch, ..., channels]`` around the framework-free functions of
:mod:`revnet.flows`; ``forward_and_log_det`` derives the log-determinant from
the program, and ``inverse`` runs it backwards. ActNorm is initialised from
data by :meth:`ActNorm.initialize`, or, inside a
:class:`~revnet.nnx.ReversibleSequence`, by the sequence's ``initialize``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from revnet._checks import check_int, check_real
from revnet._layers import data_init
from revnet._layers.checks import check_input
from revnet._layers.flow_layer import FlowMethods
from revnet.flows import (
    actnorm,
    actnorm_init,
    lu_conv,
    lu_conv_init,
    squeeze,
    unsqueeze,
)

_EXPECTED = "[batch, ..., channels]"


class FlowLayer(FlowMethods, nnx.Module):
    """A flow layer: ``_forward(x)`` returns the pure map ``h -> y``; the call,
    the derived log-determinant and the inverse follow from it."""


def _channels(where: str, x: Any, c: int) -> None:
    check_input(where, x, min_rank=2, expected=_EXPECTED)
    if x.shape[-1] != c:
        raise ValueError(
            f"{where}: expected {c} channels (the last axis), got shape "
            f"{tuple(x.shape)}."
        )


class ActNorm(FlowLayer):
    """Per-channel ``y = (x + bias) * exp(log_scale)`` (Glow), log-det the sum
    of ``log_scale`` over every position.

    It starts as the identity; :meth:`initialize` sets it from a batch so that
    the batch has zero mean and unit variance per channel.

    Example:

    >>> layer = ActNorm(4)
    >>> x = 3.0 + jax.random.normal(jax.random.key(0), (16, 4))
    >>> y = layer.initialize(x)
    >>> bool(jnp.allclose(y.mean(0), 0, atol=1e-5))
    True
    >>> layer.forward_and_log_det(x)[1].shape
    (16,)
    """

    def __init__(
        self, num_features: int, *, eps: float = 1e-6, param_dtype: Any = jnp.float32
    ):
        """Creates the layer.

        Args:
          num_features: The channels ``C`` (the last axis).
          eps: Added to the standard deviation at initialisation.
          param_dtype: The parameters' dtype.

        Raises:
          TypeError: If ``num_features`` is not an int or ``eps`` not a number.
          ValueError: If ``num_features`` or ``eps`` is not positive.
        """
        c = check_int("ActNorm", "num_features", num_features)
        self.eps = check_real(
            "ActNorm", "eps", eps, "a positive number", low=0.0, low_inclusive=False
        )
        self.bias = nnx.Param(jnp.zeros((c,), param_dtype))
        self.log_scale = nnx.Param(jnp.zeros((c,), param_dtype))

    def initialize(self, x: jax.Array) -> jax.Array:
        """Sets the parameters from the batch ``x``; returns ``self(x)``.

        Raises:
          ValueError: If ``x`` is not ``[batch, ..., C]``.
        """
        _channels("ActNorm", x, self.bias.shape[0])
        bias, log_scale = actnorm_init(x, eps=self.eps)
        self.bias[...] = bias.astype(self.bias.dtype)
        self.log_scale[...] = log_scale.astype(self.log_scale.dtype)
        return self._forward(x)(x)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Applies the layer (inside a sequence's ``initialize``, initialises
        it from ``x`` first)."""
        if data_init.active() is not None:
            return self.initialize(x)
        return super().__call__(x)

    def _forward(self, x: Any) -> Callable[[jax.Array], jax.Array]:
        _channels("ActNorm", x, self.bias.shape[0])
        bias, log_scale = self.bias[...], self.log_scale[...]
        return lambda h: actnorm(bias, log_scale, h)


class InvertibleConv1x1(FlowLayer):
    """Glow's invertible 1x1 convolution, LU-parametrised: ``y = x @ W``,
    ``W = L (U + diag(d))``, started as a random rotation; log-det per
    position ``sum(log|d|)`` (:func:`revnet.flows.lu_conv`).

    Example:

    >>> conv = InvertibleConv1x1(6, rngs=nnx.Rngs(0))
    >>> x = jnp.ones((2, 4, 4, 6))
    >>> y, log_det = conv.forward_and_log_det(x)
    >>> y.shape, bool(jnp.allclose(log_det, 0, atol=1e-4))
    ((2, 4, 4, 6), True)
    """

    def __init__(
        self, num_features: int, *, rngs: nnx.Rngs, param_dtype: Any = jnp.float32
    ):
        """Creates the layer.

        Args:
          num_features: The channels ``C``.
          rngs: The RNG streams the rotation is drawn from (``params``).
          param_dtype: The parameters' dtype.

        Raises:
          TypeError: If ``num_features`` is not an int.
          ValueError: If ``num_features`` is not positive.
        """
        c = check_int("InvertibleConv1x1", "num_features", num_features)
        lower, upper, diag = lu_conv_init(rngs.params(), c, param_dtype)
        self.lower, self.upper = nnx.Param(lower), nnx.Param(upper)
        self.diag = nnx.Param(diag)

    def _forward(self, x: Any) -> Callable[[jax.Array], jax.Array]:
        _channels("InvertibleConv1x1", x, self.diag.shape[0])
        w = (self.lower[...], self.upper[...], self.diag[...])
        return lambda h: lu_conv(*w, h)


class Squeeze(FlowLayer):
    """Space to depth, ``[b, h, w, c] -> [b, h/f, w/f, c f^2]`` (log-det 0),
    :func:`revnet.flows.squeeze` as a module.

    Example:

    >>> Squeeze()(jnp.ones((1, 4, 4, 3))).shape
    (1, 2, 2, 12)
    """

    def __init__(self, factor: int = 2):
        """Creates the layer.

        Args:
          factor: The patch's side.
        """
        self.factor = check_int("Squeeze", "factor", factor)

    def _forward(self, x: Any) -> Callable[[jax.Array], jax.Array]:
        check_input("Squeeze", x, rank=4, expected="[batch, height, width, channels]")
        return lambda h: squeeze(h, self.factor)

    def inverse(self, y: jax.Array) -> jax.Array:
        """Depth to space: rebuilds the input from the output ``y``."""
        check_input("Squeeze", y, rank=4, expected="[batch, height, width, channels]")
        return unsqueeze(y, self.factor)
