"""Haiku reversible blocks: couplings, O(1)-memory stacks and models.

Every block is plain Haiku code that the core (:func:`revnet.invertible`)
inverts; a user's own block is inverted exactly like revnet's.
"""

from revnet.blocks.coupling import AdditiveCoupling, AffineCoupling
from revnet.blocks.permutation import ChannelPermutation, Squeeze
from revnet.blocks.revnet import CONFIGS, RevNet, RevNetConfig, StageTransition
from revnet.blocks.sequence import ReversibleSequence
from revnet.blocks.sharding import REVNET_RULES, TRANSFORMER_RULES, constrain, partition
from revnet.blocks.transformer import ReversibleTransformer

__all__ = [
    "AdditiveCoupling",
    "AffineCoupling",
    "CONFIGS",
    "REVNET_RULES",
    "ChannelPermutation",
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
