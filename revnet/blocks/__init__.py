"""Haiku reversible blocks: couplings, O(1)-memory stacks and models."""

from revnet.blocks.coupling import AdditiveCoupling, AffineCoupling
from revnet.blocks.sequence import ReversibleSequence

__all__ = [
    "AdditiveCoupling",
    "AffineCoupling",
    "ReversibleSequence",
]
