"""The invertible 1x1 convolution, LU-parametrised (Glow), log-det in O(C).

The weight is ``W = L (U + diag(d))`` with ``L`` unit lower triangular and
``U`` strictly upper triangular, so ``log|det W| = sum(log|d|)``: O(C) where
the ``slogdet`` of a general matrix is O(C^3). Glow keeps a fixed permutation
``P`` in front; here it is folded into the initial matrix (the LU of a random
rotation's row-permuted self), so every parameter is a trained float.

The convolution is a :class:`revnet.custom_ivjp` function: its inverse is two
triangular solves and its log-determinant is given with ``deflogdet``, so the
derived log-determinant of a flow that uses it never factorises ``W``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.scipy.linalg import lu, solve_triangular

import revnet


def lu_matrix(lower: jax.Array, upper: jax.Array, diag: jax.Array) -> jax.Array:
    """``W = L (U + diag(d))`` from its free parameters (strict triangles of
    ``lower`` and ``upper``, and the diagonal ``d``)."""
    eye = jnp.eye(diag.shape[-1], dtype=diag.dtype)
    return (jnp.tril(lower, -1) + eye) @ (jnp.triu(upper, 1) + jnp.diag(diag))


def _forward(lower, upper, diag, x):
    return jnp.einsum("...c,cd->...d", x, lu_matrix(lower, upper, diag))


def _inverse(consts, y):
    lower, upper, diag = consts
    c = diag.shape[-1]
    rows = y.reshape(-1, c).T  # x W = y  <=>  W^T x^T = y^T
    l_t = (jnp.tril(lower, -1) + jnp.eye(c, dtype=diag.dtype)).T
    u_t = (jnp.triu(upper, 1) + jnp.diag(diag)).T
    z = solve_triangular(u_t, rows, lower=True)
    x = solve_triangular(l_t, z, lower=False, unit_diagonal=True)
    return x.T.reshape(y.shape)


def _log_det(lower, upper, diag, x):
    del lower, upper
    per_position = jnp.sum(jnp.log(jnp.abs(diag)))
    return jnp.broadcast_to(per_position, jnp.shape(x)[:-1])


_conv = revnet.custom_ivjp(_forward, num_consts=3)
_conv.definverse(_inverse)
_conv.deflogdet(_log_det)


def lu_conv(
    lower: jax.Array, upper: jax.Array, diag: jax.Array, x: jax.Array
) -> jax.Array:
    """``x @ W`` on the last axis, ``W = L (U + diag(d))``: Glow's invertible
    1x1 convolution for ``x`` of shape ``[..., height, width, C]``, or a dense
    invertible map of any ``[..., C]``.

    Args:
      lower: ``[C, C]``; its strict lower triangle is ``L``'s.
      upper: ``[C, C]``; its strict upper triangle is ``U``'s.
      diag: ``[C]``, nonzero.
      x: ``[..., C]``.

    Returns:
      ``[..., C]``. Its log-determinant per position is ``sum(log|diag|)``;
      :func:`revnet.forward_and_log_det` reads it from the function, and
      :func:`revnet.inverse` solves two triangular systems.

    Example:

    >>> import jax, jax.numpy as jnp, revnet
    >>> w = lu_conv_init(jax.random.key(0), 4)
    >>> x = jnp.ones((2, 3, 3, 4))
    >>> y, ld = revnet.forward_and_log_det(lu_conv, *w, x, known_argnums=(0, 1, 2),
    ...                                    batch_ndim=1)
    >>> y.shape, ld.shape
    ((2, 3, 3, 4), (2,))
    """
    c = jnp.shape(x)[-1] if jnp.ndim(x) else None
    shapes = (jnp.shape(lower), jnp.shape(upper), jnp.shape(diag))
    if c is None or shapes != ((c, c), (c, c), (c,)):
        raise ValueError(
            f"lu_conv: expected lower and upper [C, C], diag [C] and x [..., C]; "
            f"got {shapes[0]}, {shapes[1]}, {shapes[2]} and {jnp.shape(x)}"
        )
    return _conv(lower, upper, diag, x)


def lu_conv_init(
    key: jax.Array, channels: int, dtype: jnp.dtype = jnp.float32
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(lower, upper, diag)`` of a random rotation (with rows permuted),
    so that the convolution starts orthogonal: log-determinant zero, every
    channel mixed.

    Args:
      key: A JAX random key.
      channels: ``C``.
      dtype: The parameters' floating dtype.

    Returns:
      ``(lower, upper, diag)``.
    """
    if not isinstance(channels, int) or isinstance(channels, bool) or channels < 1:
        raise ValueError(
            f"lu_conv_init: channels must be a positive int, got {channels!r}"
        )
    a = jax.random.normal(key, (channels, channels), jnp.promote_types(dtype, "f4"))
    q, r = jnp.linalg.qr(a)
    q = q * jnp.sign(jnp.diagonal(r))
    p, l_, u = lu(q)  # q = p l u, so p^T q = l u is a rotation too
    del p
    lower = jnp.tril(l_, -1).astype(dtype)
    upper = jnp.triu(u, 1).astype(dtype)
    return lower, upper, jnp.diagonal(u).astype(dtype)
