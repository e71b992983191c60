"""ActNorm: a per-channel affine map, initialised from data (Glow)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def actnorm(bias: jax.Array, log_scale: jax.Array, x: jax.Array) -> jax.Array:
    """``(x + bias) * exp(log_scale)`` on the last axis.

    Plain ``jnp``: revnet inverts it and derives its log-determinant, the sum
    of ``log_scale`` over every position of the channels.

    Args:
      bias: ``[channels]``.
      log_scale: ``[channels]``.
      x: ``[..., channels]``.

    Returns:
      The normalised array, shaped like ``x``.

    Example:

    >>> import jax.numpy as jnp, revnet
    >>> x = jnp.ones((2, 3))
    >>> y, ld = revnet.forward_and_log_det(
    ...     actnorm, jnp.zeros(3), jnp.log(2.0) * jnp.ones(3), x,
    ...     known_argnums=(0, 1), batch_ndim=1)
    >>> y[0], ld  # 3 log 2 per example
    (Array([2., 2., 2.], dtype=float32), Array([2.0794..., 2.0794...], dtype=float32))
    """
    return (x + bias) * jnp.exp(log_scale)


def actnorm_init(x: jax.Array, *, eps: float = 1e-6) -> tuple[jax.Array, jax.Array]:
    """The data-dependent initialisation: ``(bias, log_scale)`` that give the
    batch ``x`` zero mean and unit variance per channel.

    Args:
      x: A batch, ``[..., channels]``; the statistics are over every axis
        but the last.
      eps: Added to the standard deviation (a constant channel gets a large,
        finite scale).

    Returns:
      ``(bias, log_scale)``, each ``[channels]``, with ``stop_gradient``.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> x = 3.0 + 2.0 * jax.random.normal(jax.random.key(0), (512, 2))
    >>> y = actnorm(*actnorm_init(x), x)
    >>> bool(jnp.allclose(y.mean(0), 0, atol=1e-5)), bool(jnp.allclose(y.std(0), 1))
    (True, True)
    """
    x = jax.lax.stop_gradient(jnp.asarray(x))
    if x.ndim < 2:
        raise ValueError(
            f"actnorm_init: expected a batch [..., channels] of rank >= 2, got "
            f"shape {x.shape}"
        )
    axes = tuple(range(x.ndim - 1))
    mean = jnp.mean(x, axis=axes)
    std = jnp.std(x, axis=axes)
    return -mean, -jnp.log(std + eps)
