"""Flow layers as Equinox modules: ``ActNorm``, ``InvertibleConv1x1``,
``Squeeze``.

Each acts on ONE example, as ``eqx.nn.Linear`` does (a
:class:`~revnet.eqx.ReversibleSequence` vmaps its blocks over the batch),
around the framework-free functions of :mod:`revnet.flows`.
``forward_and_log_det`` derives the log-determinant from the program, and
``inverse`` runs it backwards. ActNorm is initialised from data by
:meth:`ActNorm.initialize` (a batch), or, inside a sequence, by the
sequence's ``initialize``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

import revnet
from revnet._checks import check_int, check_real
from revnet._layers import data_init
from revnet._layers.checks import check_input
from revnet._layers.couplings import invert
from revnet.flows import (
    actnorm,
    actnorm_init,
    lu_conv,
    lu_conv_init,
    squeeze,
    unsqueeze,
)


class FlowLayer(eqx.Module):
    """A flow layer: ``_forward(x)`` returns the pure map ``h -> y``."""

    def _forward(self, x: Any) -> Callable[[jax.Array], jax.Array]:
        raise NotImplementedError

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        """Applies the layer to one example (``key`` is unused)."""
        del key
        return self._forward(x)(x)

    def forward_and_log_det(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Applies the layer to one example; returns ``(y, log_det)``, the
        scalar log-determinant derived from the program."""
        return revnet.forward_and_log_det(self._forward(x), x)

    def inverse(self, y: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        """Rebuilds the input from the output ``y``."""
        del key
        return invert(self._forward(y), y)


def _channels(where: str, x: Any, c: int, min_rank: int = 1) -> None:
    check_input(where, x, min_rank=min_rank, expected="[..., channels]")
    if x.shape[-1] != c:
        raise ValueError(
            f"{where}: expected {c} channels (the last axis), got shape "
            f"{tuple(x.shape)}."
        )


class ActNorm(FlowLayer):
    """Per-channel ``y = (x + bias) * exp(log_scale)`` (Glow), log-det the sum
    of ``log_scale`` over every position.

    It starts as the identity; :meth:`initialize` returns a copy set from a
    batch so that the batch has zero mean and unit variance per channel.
    Inside a sequence's ``initialize`` the statistics are taken over
    ``axis_name`` (the batch axis the sequence vmaps over), as
    ``eqx.nn.BatchNorm`` takes them.

    Example:

    >>> layer = ActNorm(4)
    >>> x = 3.0 + jax.random.normal(jax.random.key(0), (16, 4))
    >>> layer = layer.initialize(x)
    >>> y = jax.vmap(layer)(x)
    >>> bool(jnp.allclose(y.mean(0), 0, atol=1e-5))
    True
    >>> layer.forward_and_log_det(x[0])[1].shape
    ()
    """

    bias: jax.Array
    log_scale: jax.Array
    eps: float = eqx.field(static=True)
    axis_name: Hashable | None = eqx.field(static=True)

    def __init__(
        self,
        num_features: int,
        *,
        eps: float = 1e-6,
        axis_name: Hashable | None = "batch",
        dtype: Any = jnp.float32,
    ):
        """Creates the layer.

        Args:
          num_features: The channels ``C`` (the last axis).
          eps: Added to the standard deviation at initialisation.
          axis_name: The vmapped batch axis a sequence's ``initialize`` takes
            statistics over; None when the layer sees the whole batch.
          dtype: The parameters' dtype.

        Raises:
          TypeError: If ``num_features`` is not an int or ``eps`` not a number.
          ValueError: If ``num_features`` or ``eps`` is not positive.
        """
        c = check_int("ActNorm", "num_features", num_features)
        self.eps = check_real(
            "ActNorm", "eps", eps, "a positive number", low=0.0, low_inclusive=False
        )
        self.axis_name = axis_name
        self.bias = jnp.zeros((c,), dtype)
        self.log_scale = jnp.zeros((c,), dtype)

    def initialize(self, x: jax.Array) -> ActNorm:
        """A copy initialised from the batch ``x`` (``[batch, ..., C]``).

        Raises:
          ValueError: If ``x`` is not ``[batch, ..., C]``.
        """
        _channels("ActNorm", x, self.bias.shape[0], min_rank=2)
        return self._with(*actnorm_init(x, eps=self.eps))

    def _with(self, bias: jax.Array, log_scale: jax.Array) -> ActNorm:
        new = (bias.astype(self.bias.dtype), log_scale.astype(self.log_scale.dtype))
        return eqx.tree_at(lambda m: (m.bias, m.log_scale), self, new)

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        """Applies the layer to one example (inside a sequence's
        ``initialize``, with the parameters it reports from ``x``)."""
        found = data_init.active()
        if found is None:
            return super().__call__(x, key=key)
        _channels("ActNorm", x, self.bias.shape[0])
        axes = tuple(range(x.ndim - 1))
        mean = jnp.mean(x, axis=axes)
        square = jnp.mean(x * x, axis=axes)
        if self.axis_name is not None:
            mean, square = jax.lax.pmean((mean, square), self.axis_name)
        std = jnp.sqrt(jnp.maximum(square - mean * mean, 0.0))
        params = (-mean, -jnp.log(std + self.eps))
        found.append((self, params))
        return actnorm(*params, x)

    def _forward(self, x: Any) -> Callable[[jax.Array], jax.Array]:
        _channels("ActNorm", x, self.bias.shape[0])
        return lambda h: actnorm(self.bias, self.log_scale, h)


def actnorms(block: Any) -> list:
    """The :class:`ActNorm` modules in ``block``, in tree order."""

    def is_norm(node):
        return isinstance(node, ActNorm)

    return [n for n in jax.tree.leaves(block, is_leaf=is_norm) if is_norm(n)]


class InvertibleConv1x1(FlowLayer):
    """Glow's invertible 1x1 convolution, LU-parametrised: ``y = x @ W``,
    ``W = L (U + diag(d))``, started as a random rotation; log-det per
    position ``sum(log|d|)`` (:func:`revnet.flows.lu_conv`).

    Example:

    >>> conv = InvertibleConv1x1(6, key=jax.random.key(0))
    >>> y, log_det = conv.forward_and_log_det(jnp.ones((4, 4, 6)))
    >>> y.shape, bool(jnp.allclose(log_det, 0, atol=1e-4))
    ((4, 4, 6), True)
    """

    lower: jax.Array
    upper: jax.Array
    diag: jax.Array

    def __init__(self, num_features: int, *, key: jax.Array, dtype: Any = jnp.float32):
        """Creates the layer.

        Args:
          num_features: The channels ``C``.
          key: The PRNG key the rotation is drawn from.
          dtype: The parameters' dtype.

        Raises:
          TypeError: If ``num_features`` is not an int.
          ValueError: If ``num_features`` is not positive.
        """
        c = check_int("InvertibleConv1x1", "num_features", num_features)
        self.lower, self.upper, self.diag = lu_conv_init(key, c, dtype)

    def _forward(self, x: Any) -> Callable[[jax.Array], jax.Array]:
        _channels("InvertibleConv1x1", x, self.diag.shape[0])
        return lambda h: lu_conv(self.lower, self.upper, self.diag, h)


class Squeeze(FlowLayer):
    """Space to depth on one example, ``[h, w, c] -> [h/f, w/f, c f^2]``
    (log-det 0): :func:`revnet.flows.squeeze` as a module.

    Example:

    >>> Squeeze()(jnp.ones((4, 4, 3))).shape
    (2, 2, 12)
    """

    factor: int = eqx.field(static=True)

    def __init__(self, factor: int = 2):
        """Creates the layer.

        Args:
          factor: The patch's side.
        """
        self.factor = check_int("Squeeze", "factor", factor)

    def _forward(self, x: Any) -> Callable[[jax.Array], jax.Array]:
        check_input("Squeeze", x, min_rank=3, expected="[..., height, width, channels]")
        return lambda h: squeeze(h, self.factor)

    def inverse(self, y: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        """Depth to space: rebuilds the input from the output ``y``."""
        check_input("Squeeze", y, min_rank=3, expected="[..., height, width, channels]")
        return unsqueeze(y, self.factor)
