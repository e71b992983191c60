"""A reversible Transformer block (RevViT / Reformer style) as an NNX module.

The model width is split into two halves that form an additive coupling:
``f`` = LayerNorm + multi-head self-attention + dropout, ``g`` = LayerNorm +
MLP with dropout, as :class:`revnet.blocks.ReversibleTransformer` does for
Haiku. Stack it with :class:`~revnet.nnx.ReversibleSequence`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from revnet._layers.checks import check_transformer, check_width
from revnet.nnx.coupling import AdditiveCoupling


class _Attention(nnx.Module):
    """LayerNorm, self-attention over the time axis, dropout."""

    def __init__(
        self, width: int, num_heads: int, rate: float, param_dtype: Any, rngs: nnx.Rngs
    ):
        self.norm = nnx.LayerNorm(width, param_dtype=param_dtype, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            num_heads,
            width,
            decode=False,
            keep_rngs=False,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self.dropout = nnx.Dropout(rate, rngs=rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        return self.dropout(self.attention(self.norm(h)))


class _MLP(nnx.Module):
    """LayerNorm, a GELU MLP with dropout inside and after it."""

    def __init__(
        self, width: int, hidden: int, rate: float, param_dtype: Any, rngs: nnx.Rngs
    ):
        self.norm = nnx.LayerNorm(width, param_dtype=param_dtype, rngs=rngs)
        self.hidden = nnx.Linear(width, hidden, param_dtype=param_dtype, rngs=rngs)
        self.out = nnx.Linear(hidden, width, param_dtype=param_dtype, rngs=rngs)
        self.dropout_hidden = nnx.Dropout(rate, rngs=rngs)
        self.dropout_out = nnx.Dropout(rate, rngs=rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        h = self.dropout_hidden(jax.nn.gelu(self.hidden(self.norm(h))))
        return self.dropout_out(self.out(h))


class ReversibleTransformerBlock(AdditiveCoupling):
    """One reversible self-attention layer on ``[batch, time, model_size]``.

    ``y1 = x1 + Attn(LN(x2))``, ``y2 = x2 + MLP(LN(y1))`` on the two halves of
    the model dimension; attention heads have size ``model_size // 2 //
    num_heads``. Dropout draws from the streams the block holds, so a
    :class:`~revnet.nnx.ReversibleSequence` replays exactly the same masks in
    its backward pass. ``nnx.Module.eval()`` turns dropout off.

    Example:

    >>> block = functools.partial(ReversibleTransformerBlock, 16, 2, 32)
    >>> encoder = ReversibleSequence(block, num_layers=2, rngs=nnx.Rngs(0))
    >>> encoder(jnp.ones([2, 5, 16])).shape
    (2, 5, 16)
    """

    def __init__(
        self,
        model_size: int,
        num_heads: int,
        mlp_size: int,
        *,
        dropout_rate: float = 0.0,
        param_dtype: Any = jnp.float32,
        compute_dtype: Any = None,
        exact: bool = False,
        exact_bits: int | None = None,
        rngs: nnx.Rngs,
    ):
        """Creates the block.

        Args:
          model_size: Width of the input and output (even; each half must be
            divisible by ``num_heads``).
          num_heads: Attention heads.
          mlp_size: Hidden width of the MLP.
          dropout_rate: Dropout rate after attention, inside and after the MLP.
          param_dtype: Dtype of the parameters.
          compute_dtype: None, or a floating point dtype in which attention
            and the MLP compute (see :class:`AdditiveCoupling`); left out
            inside a sequence with a ``compute_dtype``, the sequence's.
          exact: If True, the layers run on a fixed-point grid and are
            rebuilt bit for bit (see :class:`AdditiveCoupling`).
          exact_bits: With ``exact``, the grid ``2**-exact_bits`` (None: the
            default for the stream's dtype).
          rngs: The RNG streams for the parameters and dropout.

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
        super().__init__(
            _Attention(half, num_heads, rate, param_dtype, rngs),
            _MLP(half, mlp_size, rate, param_dtype, rngs),
            compute_dtype=compute_dtype,
            exact=exact,
            exact_bits=exact_bits,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """Applies the layer to ``x`` of shape ``[batch, time, model_size]``."""
        where, expected = type(self).__name__, f"[batch, time, {self.model_size}]"
        check_width(where, x, 3, expected)
        return super().__call__(x)
