"""revnet's loops: ``while_loop`` and ``scan`` with a memory-lean backward pass.

One file per concern: :mod:`.choose` picks the backward mode from the body's
jaxpr; :mod:`.forward` runs (and caches) the forward loops; :mod:`.vjp` builds
the one custom VJP both loops share; its backward pass is :mod:`.invert`
(each carry rebuilt from the next), :mod:`.store` (the leaves that cannot be
rebuilt kept at every step) or :mod:`.checkpoint` (carries recomputed by the
binomial schedule of :mod:`.revolve`). :mod:`.anchors` keeps the carry every
few steps when inverting, against accumulated reconstruction error.
:mod:`.hooks` lets tests see the mode each loop gets and the steps a while
loop's backward pass walks back.
"""

from revnet._engine.loops import choose, revolve
from revnet._engine.loops.choose import MODES, Mode
from revnet._engine.loops.vjp import scan_function, while_function

__all__ = [
    "MODES",
    "Mode",
    "choose",
    "revolve",
    "scan_function",
    "while_function",
]
