"""Squeeze and the multi-scale split: a flow's layout steps, log-det zero.

Both are reshapes, transposes and splits, which revnet inverts by their rules
and whose log-determinant it derives as zero; they act on the trailing
``[height, width, channels]`` axes, so they serve a batch and one example
alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import revnet


def _check_image(where: str, x: jax.Array, factor: int, ndim: int = 3) -> None:
    if not isinstance(factor, int) or isinstance(factor, bool) or factor < 1:
        raise ValueError(f"{where}: factor must be a positive int, got {factor!r}")
    if jnp.ndim(x) < ndim:
        raise ValueError(
            f"{where}: expected [..., height, width, channels], got shape "
            f"{jnp.shape(x)}"
        )


def squeeze(x: jax.Array, factor: int = 2) -> jax.Array:
    """Space to depth: ``[..., h, w, c] -> [..., h/f, w/f, c f^2]``.

    Moves each ``factor x factor`` patch into channels (Glow's squeeze), so a
    coupling that splits the channels mixes neighbouring pixels.

    Args:
      x: ``[..., height, width, channels]``, height and width divisible by
        ``factor``.
      factor: The patch's side.

    Returns:
      The squeezed array.

    Raises:
      ValueError: If ``x`` has rank < 3 or its height or width is not
        divisible by ``factor``.

    Example:

    >>> import jax.numpy as jnp
    >>> squeeze(jnp.ones((2, 4, 4, 3))).shape
    (2, 2, 2, 12)
    """
    _check_image("squeeze", x, factor)
    *lead, h, w, c = jnp.shape(x)
    if h % factor or w % factor:
        raise ValueError(
            f"squeeze: height and width must be divisible by {factor}, got shape "
            f"{jnp.shape(x)}"
        )
    n = len(lead)
    x = x.reshape(*lead, h // factor, factor, w // factor, factor, c)
    order = (*range(n), n, n + 2, n + 1, n + 3, n + 4)
    return x.transpose(order).reshape(*lead, h // factor, w // factor, -1)


def unsqueeze(y: jax.Array, factor: int = 2) -> jax.Array:
    """Depth to space, the inverse of :func:`squeeze`.

    Args:
      y: ``[..., height, width, channels]``, channels divisible by
        ``factor ** 2``.
      factor: The patch's side.

    Returns:
      ``[..., height * factor, width * factor, channels / factor**2]``.

    Raises:
      ValueError: If ``y`` has rank < 3 or its channels are not divisible by
        ``factor ** 2``.

    Example:

    >>> import jax.numpy as jnp
    >>> x = jnp.arange(48.0).reshape(1, 4, 4, 3)
    >>> bool((unsqueeze(squeeze(x)) == x).all())
    True
    """
    _check_image("unsqueeze", y, factor)
    *lead, h, w, c = jnp.shape(y)
    if c % (factor * factor):
        raise ValueError(
            f"unsqueeze: channels must be divisible by {factor * factor}, got shape "
            f"{jnp.shape(y)}"
        )
    x = jax.ShapeDtypeStruct((*lead, h * factor, w * factor, c // factor**2), y.dtype)
    (rebuilt,) = revnet.inverse(lambda v: squeeze(v, factor), x)(y)
    return rebuilt


def split(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The multi-scale split: ``(kept, factored)``, the channels' halves.

    In a multi-scale flow (RealNVP, Glow) the ``factored`` half leaves the
    flow for the base density and the ``kept`` half goes on to the next
    scale; :func:`merge` puts them back.

    Args:
      x: ``[..., channels]``, channels even.

    Returns:
      ``(kept, factored)``, each ``[..., channels / 2]``.

    Raises:
      ValueError: If the last axis of ``x`` is odd.

    Example:

    >>> import jax.numpy as jnp
    >>> kept, factored = split(jnp.ones((2, 4, 4, 12)))
    >>> kept.shape, factored.shape
    ((2, 4, 4, 6), (2, 4, 4, 6))
    """
    if jnp.ndim(x) < 1 or jnp.shape(x)[-1] % 2:
        raise ValueError(f"split: the last axis must be even, got shape {jnp.shape(x)}")
    kept, factored = jnp.split(x, 2, axis=-1)
    return kept, factored


def merge(kept: jax.Array, factored: jax.Array) -> jax.Array:
    """The inverse of :func:`split`: the halves joined on the last axis.

    Example:

    >>> import jax.numpy as jnp
    >>> merge(*split(jnp.ones((2, 8)))).shape
    (2, 8)
    """
    if jnp.shape(kept) != jnp.shape(factored):
        raise ValueError(
            f"merge: the halves must have one shape, got {jnp.shape(kept)} and "
            f"{jnp.shape(factored)}"
        )
    return jnp.concatenate([kept, factored], axis=-1)
