"""Flax NNX front door: reversible stacks and couplings as ``nnx.Module``\\ s.

A stack of a user's own NNX blocks (or of revnet's couplings) is created with
NNX's scan-over-layers pattern (``nnx.split_rngs`` + ``nnx.vmap``), lifted
into a pure function with ``nnx.split``/``nnx.merge``, and run by the same
framework-free stack as the other front doors: gradients equal the
non-reversible twin's (``reversible=False``), BatchNorm statistics are written
back once per call, and dropout is replayed from the blocks' ``nnx.Rngs``
streams. It works with ``nnx.jit``, ``nnx.grad`` and ``nnx.Optimizer``, in
NNX's graph mode (the default) and tree mode; hijax variables are refused.
"""

from revnet._extras import missing_extra

try:
    import flax.nnx  # noqa: F401
except ImportError as e:
    raise missing_extra(__name__, e) from None

from revnet.nnx.coupling import AdditiveCoupling, AffineCoupling
from revnet.nnx.flow import ActNorm, InvertibleConv1x1, Squeeze
from revnet.nnx.sequence import ReversibleSequence
from revnet.nnx.transformer import ReversibleTransformerBlock

__all__ = [
    "ActNorm",
    "AdditiveCoupling",
    "AffineCoupling",
    "InvertibleConv1x1",
    "ReversibleSequence",
    "ReversibleTransformerBlock",
    "Squeeze",
]
