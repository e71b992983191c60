"""The RevNet family for CIFAR (Gomez et al., 2017, "The Reversible Residual
Network: Backpropagation Without Storing Activations").

Each stage is a :class:`~revnet.blocks.ReversibleSequence` of additive
couplings whose residual functions are pre-activation convolution units with
BatchNorm, as in the paper. Between stages a non-reversible
:class:`StageTransition` (a strided convolution) changes the resolution and
width; like any Haiku module it stores its input, as in the paper (there are
only a few such units per network).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp

import revnet
from revnet._checks import check_bool, check_float_dtype, check_int, check_mapping, fail
from revnet._layers.checks import check_input
from revnet._layers.couplings import check_exact
from revnet._layers.options import StackOptions
from revnet.blocks._names import check_name
from revnet.blocks.coupling import AdditiveCoupling
from revnet.blocks.sequence import ReversibleSequence, Stage

_BN = {"create_scale": True, "create_offset": True, "decay_rate": 0.9}


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
    bn_config = {**_BN, **(bn_config or {})}
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


class RevNetConfig(NamedTuple):
    """Architecture of a RevNet.

    Attributes:
      units: Number of reversible units (additive couplings) per stage.
      channels: Width of the initial convolution, then of each stage (the full
        activation; each coupling half has half of it). With ``bottleneck`` the
        stage widths are four times these numbers, as in ResNet.
      bottleneck: Whether residual functions are bottleneck units (3 convs).
    """

    units: tuple[int, ...]
    channels: tuple[int, ...]
    bottleneck: bool = False


CONFIGS = {
    "revnet38": RevNetConfig((3, 3, 3), (32, 32, 64, 112)),
    "revnet110": RevNetConfig((9, 9, 9), (32, 32, 64, 128)),
    "revnet164": RevNetConfig((9, 9, 9), (32, 32, 64, 128), bottleneck=True),
    "tiny": RevNetConfig((2, 2), (8, 8, 16)),
}
"""The named RevNet depths: ``RevNet("revnet38" | "revnet110" | "revnet164")``
(the paper's CIFAR configurations) and ``"tiny"`` (two stages, for tests)."""


def _check_config(module: str, config: Any) -> RevNetConfig:
    """Checks the types of a :class:`RevNetConfig`; returns it with tuples."""
    if not isinstance(config, RevNetConfig):
        expected = f"one of {sorted(CONFIGS)} or a RevNetConfig"
        raise fail(module, "depth_config", config, expected)
    fields = {}
    for field in ("units", "channels"):
        value = getattr(config, field)
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            expected = "a tuple of positive integers"
            raise fail(module, f"depth_config.{field}", value, expected)
        fields[field] = tuple(
            check_int(module, f"depth_config.{field}[{i}]", v)
            for i, v in enumerate(value)
        )
    if not fields["units"]:
        raise ValueError(
            f"{module}: depth_config.units must name at least one stage, got ()."
        )
    bottleneck = check_bool(module, "depth_config.bottleneck", config.bottleneck)
    return RevNetConfig(fields["units"], fields["channels"], bottleneck)


def residual_function(
    h: jax.Array, is_training: bool, bottleneck: bool = False
) -> jax.Array:
    """RevNet's residual function: pre-activation conv units with BatchNorm.

    Args:
      h: Input of shape ``[batch, height, width, channels]``.
      is_training: Whether BatchNorm uses batch statistics (and updates state).
      bottleneck: 1x1 -> 3x3 -> 1x1 convolutions instead of two 3x3.

    Returns:
      An array shaped like ``h``.
    """
    return conv_stack(h, is_training, h.shape[-1], bottleneck=bottleneck)[0]


class RevNet(hk.Module):
    """A RevNet image classifier (NHWC input).

    Example:

    >>> config = RevNetConfig(units=(2,), channels=(8, 8))  # or "revnet38"
    >>> def net(images, is_training):
    ...   return RevNet(config, num_classes=10)(images, is_training)
    >>> net = hk.transform_with_state(net)
    >>> images = jnp.ones([2, 8, 8, 3])
    >>> params, state = jax.jit(net.init, static_argnums=2)(
    ...     jax.random.PRNGKey(0), images, True)
    >>> logits, state = net.apply(params, state, None, images, True)
    >>> logits.shape
    (2, 10)
    """

    def __init__(
        self,
        depth_config: str | RevNetConfig,
        num_classes: int,
        reversible: bool = True,
        compute_dtype: Any = None,
        anchor_every: int | None = None,
        drift: revnet.DriftMonitor | None = None,
        name: str | None = None,
        *,
        activation_sharding: Any = None,
        decisions: str = "store",
        kinks: str = "recompute",
        exact: bool = False,
        exact_bits: int | None = None,
    ):
        """Constructs the network.

        Args:
          depth_config: ``"revnet38"``, ``"revnet110"``, ``"revnet164"``,
            ``"tiny"`` (for tests), or a :class:`RevNetConfig`.
          num_classes: Number of output logits.
          reversible: If False, the very same parameters run with ordinary
            backprop (the honest baseline).
          compute_dtype: Optional dtype (e.g. ``jnp.bfloat16``) of the residual
            functions; the residual stream stays in the input's dtype.
          anchor_every: None, or store the stream every ``anchor_every``
            units of each stage, so that reconstruction error accumulates
            over at most that many units (see :class:`ReversibleSequence`).
          drift: None, or a :class:`revnet.DriftMonitor` that receives the
            reconstruction error at each anchor of each stage.
          name: Name of the module.
          activation_sharding: None, or the ``PartitionSpec`` of the
            ``[batch, height, width, channels]`` activations between the
            units of every stage, such as ``P("data")`` (see
            :class:`ReversibleSequence`). Place the parameters with
            :func:`revnet.blocks.partition` and
            :data:`revnet.blocks.REVNET_RULES`.
          decisions: ``"store"`` (default) or ``"recompute"``: what the
            stages do with results of their units that jump, as in
            :class:`ReversibleSequence` (RevNet's own units make none).
          kinks: ``"recompute"`` (default) or ``"store"``: also store, per
            unit, the branch of every ``relu`` and ``max`` on rebuilt values,
            as in :class:`ReversibleSequence`.
          exact: If True, the units run on a fixed-point grid and each
            stage's stream is rebuilt bit for bit (see
            :class:`AdditiveCoupling`).
          exact_bits: With ``exact``, the grid ``2**-exact_bits`` (None: the
            default for the stream's dtype).

        Raises:
          TypeError: If ``depth_config`` is neither a string nor a
            :class:`RevNetConfig` (or its fields have the wrong types),
            ``num_classes`` is not an integer, ``reversible`` is not a bool,
            ``anchor_every`` not an integer, ``drift`` not a
            ``revnet.DriftMonitor``, ``activation_sharding`` not a sharding,
            or ``compute_dtype`` is not None or a floating point dtype.
          ValueError: If ``depth_config`` is unknown or inconsistent,
            ``num_classes`` or ``anchor_every`` is not positive, or
            ``decisions`` or ``kinks`` is not one of its choices.
        """
        check_name(type(self), name)
        super().__init__(name=name or "revnet")
        module = self.module_name
        if isinstance(depth_config, str):
            if depth_config not in CONFIGS:
                raise ValueError(
                    f"{module}: unknown depth_config {depth_config!r}; "
                    f"choose one of {sorted(CONFIGS)} or pass a RevNetConfig."
                )
            depth_config = CONFIGS[depth_config]
        config = _check_config(module, depth_config)
        num_classes = check_int(module, "num_classes", num_classes)
        options = StackOptions.checked(
            module,
            reversible=reversible,
            anchor_every=anchor_every,
            drift=drift,
            decisions=decisions,
            kinks=kinks,
            activation_sharding=activation_sharding,
        )
        compute_dtype = check_float_dtype(module, "compute_dtype", compute_dtype)
        exact, exact_bits = check_exact(module, exact, exact_bits)
        if len(config.channels) != len(config.units) + 1:
            raise ValueError(
                f"{module}: channels needs one entry for the initial "
                f"convolution and one per stage, got {config}."
            )
        self.config = config
        self.num_classes = num_classes
        self.reversible = options.reversible
        expand = 4 if config.bottleneck else 1
        self._init_conv = hk.Conv2D(config.channels[0], 3, name="init_conv")
        self._transitions = []
        self._stages = []
        width = config.channels[0]
        for i, units in enumerate(config.units):
            stage_width = config.channels[i + 1] * expand
            stride = 1 if i == 0 else 2
            transition = None
            if stride != 1 or stage_width != width:
                transition = StageTransition(
                    stage_width, stride, config.bottleneck, name=f"transition_{i}"
                )
            self._transitions.append(transition)
            if stage_width % 2:
                raise ValueError(
                    f"{self.module_name}: stage widths must be even to split into "
                    f"halves, got {stage_width}."
                )
            residual = functools.partial(
                residual_function, bottleneck=config.bottleneck
            )

            def unit(x, is_training, residual=residual):
                f = functools.partial(residual, is_training=is_training)
                return AdditiveCoupling(
                    f,
                    f,
                    compute_dtype=compute_dtype,
                    exact=exact,
                    exact_bits=exact_bits,
                )(x)

            self._stages.append(Stage(unit, units, options, name=f"stage_{i}"))
            width = stage_width
        self._final_bn = hk.BatchNorm(**_BN, name="final_bn")
        self._logits = hk.Linear(num_classes, name="logits")

    @property
    def stages(self) -> tuple[ReversibleSequence, ...]:
        """The reversible stages, in order."""
        return tuple(self._stages)

    def features(self, images: jax.Array, is_training: bool) -> jax.Array:
        """Returns the output of the last reversible stage.

        Args:
          images: ``[batch, height, width, channels]`` floating point images.
          is_training: Whether BatchNorm uses batch statistics and updates state.

        Returns:
          The last stage's activations, ``[batch, h, w, width]``.

        Raises:
          ValueError: If ``images`` is not rank 4.
          TypeError: If ``images`` is not floating point.
        """
        check_input(
            self.module_name,
            images,
            rank=4,
            expected="[batch, height, width, channels]",
        )
        h = self._init_conv(images)
        for transition, stage in zip(self._transitions, self._stages, strict=True):
            if transition is not None:
                h = transition(h, is_training)
            h = stage(h, is_training=is_training)
        return h

    def __call__(self, images: jax.Array, is_training: bool) -> jax.Array:
        """Returns logits ``[batch, num_classes]`` for NHWC ``images``."""
        h = self.features(images, is_training)
        h = jax.nn.relu(self._final_bn(h, is_training))
        return self._logits(jnp.mean(h, axis=(1, 2)))

    def inverse(self, features: jax.Array, is_training: bool) -> jax.Array:
        """Rebuilds the input of the last reversible stage from its output.

        The stage transitions (strided convolutions) and the classifier head are
        not invertible, so this is as far back as a RevNet can be inverted.

        Args:
          features: Output of :meth:`features`.
          is_training: The mode used for the forward pass.

        Returns:
          The input of the last reversible stage.

        Raises:
          TypeError: If ``features`` is not floating point.
        """
        return self._stages[-1].inverse(features, is_training=is_training)
