"""The framework-free layer under every front door (Haiku, Flax NNX, Equinox).

What a door offers that does not depend on its framework lives here once:
the stack that runs a door's pure layer functions (``stack.py``), the
coupling arithmetic (``couplings.py``), the checks of the stream, the blocks
and their sizes (``checks.py``), the compute dtype its couplings take from a
sequence (``precision.py``) and the residual stream's sharding
(``sharding.py``). The layer sits above the engine: it imports
``revnet._engine``'s surface, and the engine never imports it.
"""
