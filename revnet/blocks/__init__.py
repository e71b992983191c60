"""Haiku reversible blocks: couplings, O(1)-memory stacks and models."""

from revnet.blocks.coupling import AdditiveCoupling, AffineCoupling
from revnet.blocks.layers import ChannelPermutation, Squeeze, StageTransition
from revnet.blocks.revnet import CONFIGS, RevNet, RevNetConfig
from revnet.blocks.sequence import ReversibleSequence
from revnet.blocks.transformer import ReversibleTransformer

__all__ = [
    "AdditiveCoupling",
    "AffineCoupling",
    "CONFIGS",
    "ChannelPermutation",
    "ReversibleSequence",
    "ReversibleTransformer",
    "RevNet",
    "RevNetConfig",
    "Squeeze",
    "StageTransition",
]
