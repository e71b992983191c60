"""A reversible Transformer encoder (RevViT / Reformer style).

The model width is split into two halves that form an additive coupling per
layer: ``f`` = LayerNorm + multi-head self-attention, ``g`` = LayerNorm + MLP,
each followed by dropout. Splitting (rather than duplicating the input, as
Reformer does) keeps the whole encoder invertible, so :meth:`inverse` rebuilds
its input exactly.
"""

from __future__ import annotations

from typing import Any

import haiku as hk
import jax

import revnet
from revnet._checks import check_float_dtype, check_int
from revnet._layers.checks import check_transformer, check_width
from revnet._layers.couplings import check_exact
from revnet._layers.options import StackOptions
from revnet.blocks._names import check_name
from revnet.blocks.coupling import AdditiveCoupling
from revnet.blocks.sequence import Stage


def _dropout(h: jax.Array, rate: float, is_training: bool) -> jax.Array:
    if is_training and rate > 0:
        return hk.dropout(hk.next_rng_key(), rate, h)
    return h


class ReversibleTransformer(hk.Module):
    """A stack of reversible self-attention layers on ``[batch, time, model]``.

    Each layer is ``y1 = x1 + Attn(LN(x2))``, ``y2 = x2 + MLP(LN(y1))`` on the
    two halves of the model dimension (``model_size // 2`` each); attention
    heads have size ``model_size // 2 // num_heads``. With ``is_training`` and a
    positive ``dropout_rate``, an RNG key is required; the backward pass
    replays exactly the same dropout masks.

    Example:

    >>> def encoder(x, is_training):
    ...   return ReversibleTransformer(2, 2, 16, 32)(x, is_training)
    >>> encoder = hk.transform(encoder)
    >>> x = jnp.ones([2, 5, 16])
    >>> params = jax.jit(encoder.init, static_argnums=2)(
    ...     jax.random.PRNGKey(0), x, True)
    >>> encoder.apply(params, None, x, False).shape
    (2, 5, 16)
    """

    def __init__(
        self,
        num_layers: int,
        num_heads: int,
        model_size: int,
        mlp_size: int,
        dropout_rate: float = 0.0,
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
        plan: Any = None,
    ):
        """Constructs the encoder.

        Args:
          num_layers: Number of reversible layers.
          num_heads: Attention heads per layer.
          model_size: Width of the input and output (even; each half must be
            divisible by ``num_heads``).
          mlp_size: Hidden width of the MLPs.
          dropout_rate: Dropout rate after attention, inside and after the MLP.
          reversible: If False, the very same parameters run with ordinary
            backprop (the honest baseline).
          compute_dtype: Optional dtype (e.g. ``jnp.bfloat16``) of the residual
            functions; the residual stream stays in the input's dtype.
          anchor_every: None, or store the stream every ``anchor_every``
            layers, so that reconstruction error accumulates
            over at most that many layers (see :class:`ReversibleSequence`).
          drift: None, or a :class:`revnet.DriftMonitor` that receives the
            reconstruction error at each anchor.
          name: Name of the module.
          activation_sharding: None, or the ``PartitionSpec`` of the
            ``[batch, time, model]`` stream between layers, such as
            ``P("data")`` (see :class:`ReversibleSequence`). Place the
            parameters with :func:`revnet.blocks.partition` and
            :data:`revnet.blocks.TRANSFORMER_RULES`.
          decisions: ``"store"`` (default) or ``"recompute"``: what the layers
            do with results that jump (comparisons, ``argmax``/``top_k``
            routing), as in :class:`ReversibleSequence`.
          kinks: ``"recompute"`` (default) or ``"store"``: also store, per
            layer, the branch of every ``max``/``min``/``abs``/``relu`` on
            rebuilt values, as in :class:`ReversibleSequence`.
          plan: None, a :class:`revnet.StackPlan` (how many layers store
            their residuals, as plain backprop, or recompute from their input,
            as ``jax.checkpoint``, instead of inverting: the fastest choice
            where memory is to spare), or a :class:`revnet.Budget` in which
            the plan is found by compiling. Needs ``reversible=True``.
          exact: If True, the layers run on a fixed-point grid and the stream
            is rebuilt bit for bit (see :class:`AdditiveCoupling`).
          exact_bits: With ``exact``, the grid ``2**-exact_bits`` (None: the
            default for the stream's dtype).

        Raises:
          TypeError: If ``num_layers``, ``num_heads``, ``model_size`` or
            ``mlp_size`` is not an integer, ``dropout_rate`` not a number,
            ``reversible`` not a bool, ``anchor_every`` not an integer,
            ``drift`` not a ``revnet.DriftMonitor``, ``compute_dtype`` not
            None or a floating point dtype, or ``activation_sharding`` not
            None or a sharding.
          ValueError: If an integer argument is not positive, ``dropout_rate`` is
            not in ``[0, 1)``, ``model_size`` is odd or its halves are not
            divisible by ``num_heads``, or ``decisions`` or ``kinks`` is not
            one of its choices.
        """
        check_name(type(self), name)
        super().__init__(name=name)
        module = self.module_name
        num_layers = check_int(module, "num_layers", num_layers)
        model_size, num_heads, mlp_size, dropout_rate = check_transformer(
            module, model_size, num_heads, mlp_size, dropout_rate
        )
        options = StackOptions.checked(
            module,
            reversible=reversible,
            anchor_every=anchor_every,
            drift=drift,
            decisions=decisions,
            kinks=kinks,
            activation_sharding=activation_sharding,
            plan=plan,
        )
        compute_dtype = check_float_dtype(module, "compute_dtype", compute_dtype)
        exact, exact_bits = check_exact(module, exact, exact_bits)
        self.model_size = model_size
        half = model_size // 2

        def attention(h, is_training):
            h = hk.LayerNorm(-1, create_scale=True, create_offset=True)(h)
            h = hk.MultiHeadAttention(
                num_heads,
                half // num_heads,
                w_init=hk.initializers.VarianceScaling(1.0),
                model_size=half,
            )(h, h, h)
            return _dropout(h, dropout_rate, is_training)

        def mlp(h, is_training):
            h = hk.LayerNorm(-1, create_scale=True, create_offset=True)(h)
            h = jax.nn.gelu(hk.Linear(mlp_size)(h))
            h = hk.Linear(half)(_dropout(h, dropout_rate, is_training))
            return _dropout(h, dropout_rate, is_training)

        def layer(x, is_training):
            return AdditiveCoupling(
                lambda h: attention(h, is_training),
                lambda h: mlp(h, is_training),
                compute_dtype=compute_dtype,
                exact=exact,
                exact_bits=exact_bits,
            )(x)

        self._layers = Stage(layer, num_layers, options, name="layers")

    def _check(self, x: Any) -> None:
        check_width(self.module_name, x, 3, f"[batch, time, {self.model_size}]")

    def __call__(self, x: jax.Array, is_training: bool) -> jax.Array:
        """Encodes ``x`` of shape ``[batch, time, model_size]``."""
        self._check(x)
        return self._layers(x, is_training=is_training)

    def inverse(self, y: jax.Array, is_training: bool) -> jax.Array:
        """Rebuilds the input from the output ``y``.

        Use the same RNG key and ``is_training`` as the forward call to replay
        dropout: with dropout, call ``inverse`` in a separate ``apply`` with
        the same ``rng`` as the forward call's (inside the same ``apply`` the
        rng sequence has advanced, so the masks differ).

        Args:
          y: Output of this encoder, ``[batch, time, model_size]``.
          is_training: The mode of the forward call.

        Returns:
          The input ``x`` with ``self(x) == y`` (up to rounding).

        Raises:
          ValueError: If ``y`` has the wrong shape.
          TypeError: If ``y`` is not floating point.
        """
        self._check(y)
        return self._layers.inverse(y, is_training=is_training)
