"""Invertible permutations without parameters: ``Squeeze`` and ``ChannelPermutation``.

Both are plain ``jnp`` code that can be chained with couplings inside a block
of a :class:`~revnet.blocks.ReversibleSequence`. The core inverts the reshapes
and transposes of :class:`Squeeze` and the reversal of
``ChannelPermutation("reverse")`` by their rules. The core's rule for a
permuting gather solves it by a scatter and checks at run time that the
indices are a permutation; the random permutation is known to be one, so it is
a :class:`revnet.custom_ivjp` function that carries its own fused inverse and
VJP: gathers by the inverse permutation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import revnet
from revnet._checks import check_choice, check_int
from revnet._layers.checks import check_input
from revnet.blocks._names import check_name
from revnet.blocks.flow import FlowLayer
from revnet.flows import squeeze, unsqueeze


class Squeeze(FlowLayer):
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
        self.factor = check_int(self.module_name, "factor", factor)

    def _forward(self, x: Any) -> Callable[[jax.Array], jax.Array]:
        expected = (
            f"[batch, height, width, channels] with height and width divisible by "
            f"{self.factor}"
        )
        check_input(self.module_name, x, rank=4, expected=expected)
        _, h, w, _ = x.shape
        if h % self.factor or w % self.factor:
            raise ValueError(
                f"{self.module_name}: expected shape {expected}, got {tuple(x.shape)}."
            )
        return lambda v: squeeze(v, self.factor)

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
        f = self.factor
        if y.shape[-1] % (f * f):
            raise ValueError(
                f"{self.module_name}: the channels of the output must be divisible by "
                f"{f * f}, got shape {tuple(y.shape)}."
            )
        return unsqueeze(y, f)


def _gather(indices: jax.Array, backward: jax.Array, x: jax.Array) -> jax.Array:
    del backward  # Used by the inverse only.
    return x[..., indices]


def _ungather(consts: tuple, y: jax.Array, dy: jax.Array) -> tuple[tuple, tuple]:
    indices, backward = consts
    zeros = (jnp.zeros_like(indices), jnp.zeros_like(backward))
    return (y[..., backward],), (*zeros, dy[..., backward])


# The index arrays are leading arguments (constants of the inversion), not
# closed-over values: a function the core inverts by a user-given rule must not
# close over arrays.
_permute = revnet.custom_ivjp(_gather, num_consts=2)
_permute.defivjp(_ungather)
_permute.deflogdet(lambda indices, backward, x: jnp.zeros(x.shape[:-1], x.dtype))


def permute_last_axis(x: jax.Array, perm: np.ndarray) -> jax.Array:
    """``x[..., perm]`` as a function the core inverts.

    Args:
      x: Array whose last axis is permuted.
      perm: A permutation of ``range(x.shape[-1])``.

    Returns:
      ``x[..., perm]``. Inside :func:`revnet.invertible` functions the fused
      inverse-and-VJP gathers the output and its cotangent by the inverse
      permutation.
    """
    indices = np.asarray(perm, np.int32)
    return _permute(jnp.asarray(indices), jnp.asarray(np.argsort(indices)), x)


class ChannelPermutation(FlowLayer):
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

    def _permute(self, x: Any):
        check_input(self.module_name, x, min_rank=1, expected="[..., channels]")
        if self.kind == "reverse":
            return lambda v: jnp.flip(v, axis=-1)
        perm = np.random.RandomState(self.seed).permutation(x.shape[-1])
        return lambda v: permute_last_axis(v, perm)

    def _forward(self, x: Any) -> Callable[[jax.Array], jax.Array]:
        return self._permute(x)
