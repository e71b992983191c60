"""Helpers for real reversible models.

* :class:`Squeeze` (space-to-depth, i-RevNet's invertible downsampling) and
  :class:`ChannelPermutation` are invertible, have no parameters, and can be
  chained with couplings inside a block of a ``ReversibleSequence``.
* :class:`StageTransition` is RevNet's *non*-reversible downsampling unit
  between stages (a strided convolution); like any Haiku module it stores its
  input for the backward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import haiku as hk
import jax
import numpy as np

from revnet.blocks import _tape
from revnet.blocks._checks import (
    check_bool,
    check_choice,
    check_input,
    check_int,
    check_mapping,
    check_name,
)


class PermutationRule(NamedTuple):
    """A parameterless permutation of the elements of ``x``.

    Its Jacobian is a permutation matrix, so the cotangent of the input is the
    inverse permutation of the output's cotangent.
    """

    permute: Callable[[jax.Array], jax.Array]
    unpermute: Callable[[jax.Array], jax.Array]

    def forward(self, params, aux, x):
        return self.permute(x), ()

    def inverse(self, params, aux, y):
        return self.unpermute(y)

    def backward(self, params, aux, y, dy):
        return self.unpermute(y), self.unpermute(dy), params


def _apply_permutation(rule: PermutationRule, x: Any, out_shape: tuple) -> Any:
    if _tape.is_recording():
        return _tape.emit(rule, (), (), x, out_shape)
    return rule.permute(x)


def space_to_depth(x: jax.Array, factor: int) -> jax.Array:
    """``[b, h, w, c] -> [b, h / factor, w / factor, c * factor**2]``."""
    b, h, w, c = x.shape
    x = x.reshape(b, h // factor, factor, w // factor, factor, c)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(
        b, h // factor, w // factor, factor * factor * c
    )


def depth_to_space(y: jax.Array, factor: int) -> jax.Array:
    """The inverse of :func:`space_to_depth`."""
    b, h, w, c = y.shape
    c //= factor * factor
    y = y.reshape(b, h, w, factor, factor, c)
    return y.transpose(0, 1, 3, 2, 4, 5).reshape(b, h * factor, w * factor, c)


class Squeeze(hk.Module):
    """Invertible space-to-depth downsampling (i-RevNet, Glow's squeeze).

    Moves each ``factor x factor`` spatial patch into channels:
    ``[b, h, w, c] -> [b, h / factor, w / factor, c * factor**2]``.

    Example:

    >>> squeeze = hk.transform(lambda x: Squeeze()(x))
    >>> squeeze.apply({}, None, jnp.ones([1, 4, 4, 3])).shape
    (1, 2, 2, 12)
    """

    def __init__(self, factor: int = 2, name: str | None = None):
        """Constructs the module.

        Args:
          factor: Spatial downsampling factor, a positive integer.
          name: Name of the module.

        Raises:
          TypeError: If ``factor`` is not an integer.
          ValueError: If ``factor`` is not positive.
        """
        check_name(type(self), name)
        super().__init__(name=name)
        factor = check_int(self.module_name, "factor", factor)
        self.factor = factor
        self._rule = PermutationRule(
            lambda x: space_to_depth(x, factor), lambda y: depth_to_space(y, factor)
        )

    def _check(self, x: Any, channel_multiple: int) -> None:
        expected = (
            f"[batch, height, width, channels] with height and width divisible by "
            f"{self.factor}"
        )
        check_input(self.module_name, x, rank=4, expected=expected)
        _, h, w, c = x.shape
        if h % self.factor or w % self.factor or c % channel_multiple:
            raise ValueError(
                f"{self.module_name}: expected shape {expected}, got {tuple(x.shape)}."
            )

    def __call__(self, x: jax.Array) -> jax.Array:
        """Squeezes ``x`` of shape ``[batch, height, width, channels]``."""
        self._check(x, 1)
        b, h, w, c = x.shape
        f = self.factor
        return _apply_permutation(self._rule, x, (b, h // f, w // f, c * f * f))

    def inverse(self, y: jax.Array) -> jax.Array:
        """Depth-to-space: rebuilds the input from the output ``y``.

        Args:
          y: Output of this module, ``[batch, height, width, channels]``.

        Returns:
          ``[batch, height * factor, width * factor, channels / factor**2]``.

        Raises:
          ValueError: If ``y`` is not rank 4 or its channels are not divisible by
            ``factor**2``.
          TypeError: If ``y`` is not floating point.
        """
        check_input(self.module_name, y, rank=4, expected="[batch, h, w, channels]")
        if y.shape[-1] % (self.factor**2):
            raise ValueError(
                f"{self.module_name}: the channels of the output must be divisible by "
                f"{self.factor**2}, got shape {tuple(y.shape)}."
            )
        return self._rule.unpermute(y)


class ChannelPermutation(hk.Module):
    """A fixed permutation of the last axis (mixes the two coupling halves).

    Example:

    >>> perm = hk.transform(lambda x: ChannelPermutation("reverse")(x))
    >>> perm.apply({}, None, jnp.arange(4.0)[None])
    Array([[3., 2., 1., 0.]], dtype=float32)
    """

    def __init__(self, kind: str = "random", seed: int = 0, name: str | None = None):
        """Constructs the module.

        Args:
          kind: ``"random"`` for a permutation drawn once from ``seed`` (fixed, not
            a parameter), or ``"reverse"`` to reverse the channel order.
          seed: Seed of the random permutation, an integer in ``[0, 2**32)``.
          name: Name of the module.

        Raises:
          TypeError: If ``kind`` is not a string or ``seed`` not an integer.
          ValueError: If ``kind`` is unknown or ``seed`` out of range.
        """
        check_name(type(self), name)
        super().__init__(name=name)
        module = self.module_name
        self.kind = check_choice(module, "kind", kind, ("random", "reverse"))
        self.seed = check_int(module, "seed", seed, minimum=0)
        if self.seed >= 2**32:
            raise ValueError(
                f"{module}: seed must be a non-negative integer below 2**32, got "
                f"{self.seed}."
            )

    def _rule(self, x: Any) -> PermutationRule:
        check_input(self.module_name, x, min_rank=1, expected="[..., channels]")
        channels = x.shape[-1]
        if self.kind == "reverse":
            perm = np.arange(channels)[::-1]
        else:
            perm = np.random.RandomState(self.seed).permutation(channels)
        inv = np.argsort(perm)
        return PermutationRule(lambda x: x[..., perm], lambda y: y[..., inv])

    def __call__(self, x: jax.Array) -> jax.Array:
        """Permutes the last axis of ``x``."""
        return _apply_permutation(self._rule(x), x, x.shape)

    def inverse(self, y: jax.Array) -> jax.Array:
        """Undoes the permutation of the last axis of ``y``.

        Args:
          y: Output of this module, ``[..., channels]``.

        Returns:
          The input with ``self(x) == y``.

        Raises:
          TypeError: If ``y`` is not floating point.
        """
        return self._rule(y).unpermute(y)


_BN_DEFAULTS = {"create_scale": True, "create_offset": True, "decay_rate": 0.9}


def conv_stack(
    h: jax.Array,
    is_training: bool,
    output_channels: int,
    bottleneck: bool = False,
    stride: int = 1,
    bn_config: dict[str, Any] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Pre-activation convolutions: (BatchNorm, ReLU, conv) two or three times.

    Args:
      h: Input of shape ``[batch, height, width, channels]``.
      is_training: Whether BatchNorm uses batch statistics (and updates state).
      output_channels: Channels of the output.
      bottleneck: 1x1 -> 3x3 -> 1x1 convolutions (inner width
        ``output_channels // 4``) instead of two 3x3 convolutions.
      stride: Stride of the first 3x3 convolution.
      bn_config: Keyword arguments of ``hk.BatchNorm`` (defaults: scale and
        offset, ``decay_rate=0.9``).

    Returns:
      ``(output, preactivation)``, the latter being the first
      ``relu(batch_norm(h))`` (for a projection shortcut).
    """
    bn_config = {**_BN_DEFAULTS, **(bn_config or {})}
    if bottleneck:
        inner = output_channels // 4
        kernels, widths, strides = (
            (1, 3, 1),
            (inner, inner, output_channels),
            (1, stride, 1),
        )
    else:
        kernels, widths, strides = (3, 3), (output_channels,) * 2, (stride, 1)
    preactivation = None
    layers = zip(kernels, widths, strides, strict=True)
    for i, (kernel, width, layer_stride) in enumerate(layers):
        h = jax.nn.relu(hk.BatchNorm(**bn_config, name=f"bn_{i}")(h, is_training))
        preactivation = h if preactivation is None else preactivation
        h = hk.Conv2D(width, kernel, stride=layer_stride, name=f"conv_{i}")(h)
    return h, preactivation


class StageTransition(hk.Module):
    """RevNet's non-reversible downsampling unit between stages.

    A pre-activation residual unit (see :func:`conv_stack`) whose first 3x3
    convolution is strided, with a strided 1x1 projection shortcut. It changes
    the number of channels and the resolution, so it cannot be inverted: like
    any Haiku module, it stores its input for the backward pass (RevNet does the
    same; there are only a few such units per network).

    Example:

    >>> net = hk.transform_with_state(lambda x: StageTransition(8, 2)(x, True))
    >>> x = jnp.ones([2, 8, 8, 4])
    >>> params, state = net.init(jax.random.PRNGKey(0), x)
    >>> net.apply(params, state, None, x)[0].shape
    (2, 4, 4, 8)
    """

    def __init__(
        self,
        output_channels: int,
        stride: int = 2,
        bottleneck: bool = False,
        bn_config: dict[str, Any] | None = None,
        name: str | None = None,
    ):
        """Constructs the unit.

        Args:
          output_channels: Channels of the output.
          stride: Spatial stride.
          bottleneck: Whether to use a 1x1 -> 3x3 -> 1x1 bottleneck.
          bn_config: Keyword arguments of ``hk.BatchNorm``.
          name: Name of the module.

        Raises:
          TypeError: If ``output_channels`` or ``stride`` is not an integer,
            ``bottleneck`` not a bool, or ``bn_config`` not a dict or None.
          ValueError: If ``output_channels`` or ``stride`` is not positive, or
            ``bottleneck`` is set and ``output_channels`` is below 4.
        """
        check_name(type(self), name)
        super().__init__(name=name)
        module = self.module_name
        self.output_channels = check_int(module, "output_channels", output_channels)
        self.stride = check_int(module, "stride", stride)
        self.bottleneck = check_bool(module, "bottleneck", bottleneck)
        self.bn_config = check_mapping(module, "bn_config", bn_config)
        if self.bottleneck and self.output_channels < 4:
            raise ValueError(
                f"{module}: output_channels must be at least 4 with bottleneck "
                f"(inner width output_channels // 4), got {self.output_channels}."
            )

    def __call__(self, x: jax.Array, is_training: bool) -> jax.Array:
        """Downsamples ``x`` of shape ``[batch, height, width, channels]``."""
        check_input(self.module_name, x, rank=4, expected="[batch, h, w, channels]")
        h, preactivation = conv_stack(
            x,
            is_training,
            self.output_channels,
            bottleneck=self.bottleneck,
            stride=self.stride,
            bn_config=self.bn_config,
        )
        shortcut = hk.Conv2D(
            self.output_channels, 1, stride=self.stride, with_bias=False, name="proj"
        )(preactivation)
        return h + shortcut

    def inverse(self, y: jax.Array, is_training: bool = False) -> jax.Array:
        """Always raises: a strided convolution has no inverse.

        Raises:
          NotImplementedError: Always.
        """
        raise NotImplementedError(
            f"{self.module_name}: a strided stage transition is not invertible; "
            "use Squeeze for invertible downsampling."
        )
