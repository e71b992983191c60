"""The standard-normal base density of a flow."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp


class StandardNormal:
    """The standard normal on an event of fixed shape, the usual flow base.

    A flow ``z = f(x)`` has ``log p(x) = log_prob(z) + log|det df/dx|``; with
    :func:`revnet.forward_and_log_det` (``batch_ndim=1``) both terms are one
    per example. It holds no parameters, so it serves every front door.

    Args:
      event_shape: The shape of one sample, such as ``(8, 8, 12)``.

    Raises:
      ValueError: If ``event_shape`` is not a tuple of positive ints.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> base = StandardNormal((4,))
    >>> z = base.sample(jax.random.key(0), (3,))
    >>> z.shape, base.log_prob(z).shape
    ((3, 4), (3,))
    >>> float(base.log_prob(jnp.zeros(4)))  # -2 log(2 pi)
    -3.675754...
    """

    def __init__(self, event_shape: Sequence[int]):
        shape = tuple(event_shape) if isinstance(event_shape, Sequence) else None
        if shape is None or not all(
            isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape
        ):
            raise ValueError(
                f"StandardNormal: event_shape must be a tuple of positive ints, got "
                f"{event_shape!r}"
            )
        self.event_shape = shape

    def __repr__(self) -> str:
        return f"StandardNormal({self.event_shape})"

    def log_prob(self, z: jax.Array) -> jax.Array:
        """``log N(z; 0, I)``, summed over the event axes.

        Args:
          z: ``[*batch, *event_shape]``.

        Returns:
          ``[*batch]``, in ``z``'s floating dtype.

        Raises:
          ValueError: If ``z`` does not end with the event shape.
        """
        k = len(self.event_shape)
        shape = jnp.shape(z)
        if shape[len(shape) - k :] != self.event_shape or len(shape) < k:
            raise ValueError(
                f"StandardNormal.log_prob: z must end with the event shape "
                f"{self.event_shape}, got shape {shape}"
            )
        z = jnp.asarray(z)
        if not jnp.issubdtype(z.dtype, jnp.floating):
            z = z.astype(jnp.float32)
        axes = tuple(range(len(shape) - k, len(shape)))
        size = math.prod(self.event_shape)
        return -0.5 * jnp.sum(z * z, axis=axes) - 0.5 * size * math.log(2 * math.pi)

    def sample(
        self,
        key: jax.Array,
        sample_shape: Sequence[int] = (),
        dtype: jnp.dtype = jnp.float32,
    ) -> jax.Array:
        """Draws ``[*sample_shape, *event_shape]`` standard-normal values.

        Args:
          key: A JAX random key.
          sample_shape: The leading (batch) shape.
          dtype: A floating dtype.

        Returns:
          The sample.
        """
        shape = (*tuple(sample_shape), *self.event_shape)
        return jax.random.normal(key, shape, dtype)
