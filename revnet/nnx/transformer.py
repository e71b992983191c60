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

from revnet._block_checks import check_input
from revnet._checks import check_int, check_real
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
          rngs: The RNG streams for the parameters and dropout.

        Raises:
          TypeError: If an integer argument is not an integer, or
            ``dropout_rate`` not a number.
          ValueError: If an integer argument is not positive, ``dropout_rate``
            is not in ``[0, 1)``, or ``model_size`` is odd or its halves are
            not divisible by ``num_heads``.
        """
        where = type(self).__name__
        model_size = check_int(where, "model_size", model_size)
        num_heads = check_int(where, "num_heads", num_heads)
        mlp_size = check_int(where, "mlp_size", mlp_size)
        rate = check_real(
            where, "dropout_rate", dropout_rate, "a number in [0, 1)", 0.0, 1.0
        )
        if model_size % 2 or (model_size // 2) % num_heads:
            raise ValueError(
                f"{where}: model_size must be even and model_size // 2 divisible "
                f"by num_heads, got model_size={model_size}, num_heads={num_heads}."
            )
        self.model_size = model_size
        half = model_size // 2
        super().__init__(
            _Attention(half, num_heads, rate, param_dtype, rngs),
            _MLP(half, mlp_size, rate, param_dtype, rngs),
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """Applies the layer to ``x`` of shape ``[batch, time, model_size]``."""
        expected = f"[batch, time, {self.model_size}]"
        check_input(type(self).__name__, x, rank=3, expected=expected)
        if x.shape[-1] != self.model_size:
            raise ValueError(
                f"{type(self).__name__}: expected an input of shape {expected}, "
                f"got {tuple(x.shape)}."
            )
        return super().__call__(x)
