"""Haiku reversible blocks: couplings, O(1)-memory stacks and models.

Every block is plain Haiku code that the core (:func:`revnet.invertible`)
inverts; a user's own block is inverted exactly like revnet's. Every module
has an ``inverse`` method.

* :class:`ReversibleSequence`: ``num_layers`` copies of your own block (any
  Haiku function invertible equation by equation) in one scan whose backward
  pass stores no activations; ``reversible=False`` runs the same parameters
  with ordinary backprop, ``anchor_every``/``drift`` bound and read the
  reconstruction error.
* :class:`AdditiveCoupling`, :class:`AffineCoupling` (with
  ``forward_and_log_det``): the couplings, with ``compute_dtype``.
* :class:`ActNorm`, :class:`InvertibleConv1x1` (LU-parametrised): flow layers
  with ``forward_and_log_det``, as are the sequence and the two below
  (:mod:`revnet.flows` has the base density and the multi-scale split).
* :class:`Squeeze`, :class:`ChannelPermutation`, :class:`StageTransition`,
  :class:`RevNet` (``"revnet38"``, ``"revnet110"``, ``"revnet164"``;
  :data:`CONFIGS`) and :class:`ReversibleTransformer`: ready-made models.
* :func:`partition` with :data:`TRANSFORMER_RULES` or :data:`REVNET_RULES`
  places the parameters on a mesh; :func:`constrain` and the modules'
  ``activation_sharding=`` shard the residual stream.

The guides ``docs/guides/haiku.md`` and ``docs/guides/scaling.md`` show
each in use.
Needs ``pip install '.[haiku]'``.

Example:

>>> import haiku as hk, jax, jax.numpy as jnp
>>> from revnet import blocks
>>> def block(h):
...     f = lambda a: jnp.tanh(hk.Linear(a.shape[-1])(a))
...     return blocks.AdditiveCoupling(f, f)(h)
>>> model = hk.transform(lambda x: blocks.ReversibleSequence(block, 8)(x))
>>> x = jnp.ones((2, 8))
>>> params = model.init(jax.random.key(0), x)
>>> model.apply(params, None, x).shape
(2, 8)
"""

from revnet._extras import missing_extra

try:
    import haiku  # noqa: F401
except ImportError as e:
    raise missing_extra(__name__, e) from None

from revnet.blocks.coupling import AdditiveCoupling, AffineCoupling
from revnet.blocks.flow import ActNorm, InvertibleConv1x1
from revnet.blocks.permutation import ChannelPermutation, Squeeze
from revnet.blocks.revnet import CONFIGS, RevNet, RevNetConfig, StageTransition
from revnet.blocks.sequence import ReversibleSequence
from revnet.blocks.sharding import REVNET_RULES, TRANSFORMER_RULES, constrain, partition
from revnet.blocks.transformer import ReversibleTransformer

__all__ = [
    "ActNorm",
    "AdditiveCoupling",
    "AffineCoupling",
    "CONFIGS",
    "REVNET_RULES",
    "ChannelPermutation",
    "InvertibleConv1x1",
    "ReversibleSequence",
    "ReversibleTransformer",
    "RevNet",
    "RevNetConfig",
    "Squeeze",
    "StageTransition",
    "TRANSFORMER_RULES",
    "constrain",
    "partition",
]
