"""A reversible Transformer block (RevViT / Reformer style) as an Equinox module.

The model width is split into two halves that form an additive coupling:
``f`` = LayerNorm + multi-head self-attention + dropout, ``g`` = LayerNorm +
MLP with dropout, as :class:`revnet.blocks.ReversibleTransformer` (Haiku) and
:class:`revnet.nnx.ReversibleTransformerBlock` do. Like ``eqx.nn`` layers it
acts on ONE example, ``[time, model_size]``; stack it with
:class:`~revnet.eqx.ReversibleSequence`, which vmaps it over the batch.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax

from revnet._layers.checks import check_transformer, check_width
from revnet.eqx._call import split_key
from revnet.eqx.coupling import AdditiveCoupling


class _Attention(eqx.Module):
    """LayerNorm, self-attention over the time axis, dropout."""

    norm: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    dropout: eqx.nn.Dropout

    def __init__(self, width: int, num_heads: int, rate: float, dtype: Any, key):
        self.norm = eqx.nn.LayerNorm(width, dtype=dtype)
        self.attention = eqx.nn.MultiheadAttention(
            num_heads,
            width,
            use_query_bias=True,
            use_key_bias=True,
            use_value_bias=True,
            use_output_bias=True,
            dtype=dtype,
            key=key,
        )
        self.dropout = eqx.nn.Dropout(rate)

    def __call__(self, h: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        u = jax.vmap(self.norm)(h)
        return self.dropout(self.attention(u, u, u), key=key)


class _MLP(eqx.Module):
    """LayerNorm, a GELU MLP with dropout inside and after it."""

    norm: eqx.nn.LayerNorm
    hidden: eqx.nn.Linear
    out: eqx.nn.Linear
    dropout_hidden: eqx.nn.Dropout
    dropout_out: eqx.nn.Dropout

    def __init__(self, width: int, hidden: int, rate: float, dtype: Any, key):
        k1, k2 = jax.random.split(key)
        self.norm = eqx.nn.LayerNorm(width, dtype=dtype)
        self.hidden = eqx.nn.Linear(width, hidden, dtype=dtype, key=k1)
        self.out = eqx.nn.Linear(hidden, width, dtype=dtype, key=k2)
        self.dropout_hidden = eqx.nn.Dropout(rate)
        self.dropout_out = eqx.nn.Dropout(rate)

    def __call__(self, h: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        k1, k2 = split_key(key, 2)
        u = jax.nn.gelu(jax.vmap(self.hidden)(jax.vmap(self.norm)(h)))
        u = self.dropout_hidden(u, key=k1)
        return self.dropout_out(jax.vmap(self.out)(u), key=k2)


class ReversibleTransformerBlock(AdditiveCoupling):
    """One reversible self-attention layer on ONE example ``[time, model_size]``.

    ``y1 = x1 + Attn(LN(x2))``, ``y2 = x2 + MLP(LN(y1))`` on the two halves of
    the model dimension; attention heads have size ``model_size // 2 //
    num_heads``. Dropout draws from the key the block is called with, so a
    :class:`~revnet.eqx.ReversibleSequence` replays exactly the same masks in
    its backward pass; ``eqx.nn.inference_mode`` turns dropout off.

    Example:

    >>> make = lambda key: ReversibleTransformerBlock(16, 2, 32, key=key)
    >>> encoder = ReversibleSequence(make, 2, key=jax.random.key(0))
    >>> encoder(jnp.ones([3, 5, 16])).shape
    (3, 5, 16)
    """

    model_size: int = eqx.field(static=True)

    def __init__(
        self,
        model_size: int,
        num_heads: int,
        mlp_size: int,
        *,
        dropout_rate: float = 0.0,
        dtype: Any = None,
        compute_dtype: Any = None,
        exact: bool = False,
        exact_bits: int | None = None,
        key: jax.Array,
    ):
        """Builds the block.

        Args:
          model_size: Width of the input and output (even; each half must be
            divisible by ``num_heads``).
          num_heads: Attention heads.
          mlp_size: Hidden width of the MLP.
          dropout_rate: Dropout rate after attention, inside and after the MLP.
          dtype: Dtype of the parameters (Equinox's default when None).
          compute_dtype: None, or a floating point dtype in which attention
            and the MLP compute (see :class:`AdditiveCoupling`).
          exact: If True, the layers run on a fixed-point grid and are
            rebuilt bit for bit (see :class:`AdditiveCoupling`).
          exact_bits: With ``exact``, the grid ``2**-exact_bits`` (None: the
            default for the stream's dtype).
          key: PRNG key for the parameters.

        Raises:
          TypeError: If an integer argument is not an integer,
            ``dropout_rate`` not a number or ``compute_dtype`` not a floating
            point dtype.
          ValueError: If an integer argument is not positive, ``dropout_rate``
            is not in ``[0, 1)``, or ``model_size`` is odd or its halves are
            not divisible by ``num_heads``.
        """
        model_size, num_heads, mlp_size, rate = check_transformer(
            type(self).__name__, model_size, num_heads, mlp_size, dropout_rate
        )
        self.model_size = model_size
        half = model_size // 2
        kf, kg = jax.random.split(key)
        super().__init__(
            _Attention(half, num_heads, rate, dtype, kf),
            _MLP(half, mlp_size, rate, dtype, kg),
            compute_dtype=compute_dtype,
            exact=exact,
            exact_bits=exact_bits,
        )

    def __call__(
        self,
        x: jax.Array,
        state: eqx.nn.State | None = None,
        *,
        key: jax.Array | None = None,
    ) -> Any:
        """Applies the layer to one example ``x`` of shape ``[time, model_size]``."""
        where, expected = type(self).__name__, f"[time, {self.model_size}]"
        check_width(
            where,
            x,
            2,
            expected,
            " (one example; jax.vmap it or stack it in a ReversibleSequence)",
        )
        return super().__call__(x, state, key=key)
