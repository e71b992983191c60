"""Equinox front door: reversible stacks and couplings as Equinox modules.

Modules are pytrees, randomness is an explicit ``key=``, BatchNorm statistics
live in an ``eqx.nn.State``. A block is any Equinox module the core can run
backwards equation by equation (plain ``jnp`` code around ``eqx.nn.Linear``,
``eqx.nn.MLP``, ``eqx.nn.LayerNorm``, ``eqx.nn.BatchNorm``, ``eqx.nn.Dropout``,
or revnet's couplings and :class:`ReversibleTransformerBlock`).
:class:`ReversibleSequence` stacks ``num_layers`` copies built with
``eqx.filter_vmap``, as in Equinox's scan-over-layers recipe (or a list of
different blocks), and runs them on revnet's framework-free stack
(``revnet/_layers/stack.py``), the one under the Haiku and Flax NNX front doors too.
Needs ``pip install '.[equinox]'``.
"""

from revnet._extras import missing_extra

try:
    import equinox  # noqa: F401
except ImportError as e:
    raise missing_extra(__name__, e) from None

from revnet.eqx.coupling import AdditiveCoupling, AffineCoupling
from revnet.eqx.flow import ActNorm, InvertibleConv1x1, Squeeze
from revnet.eqx.sequence import ReversibleSequence
from revnet.eqx.transformer import ReversibleTransformerBlock

__all__ = [
    "ActNorm",
    "AdditiveCoupling",
    "AffineCoupling",
    "InvertibleConv1x1",
    "ReversibleSequence",
    "ReversibleTransformerBlock",
    "Squeeze",
]
