"""The framework-free layer under every front door (Haiku, Flax NNX, Equinox).

What a door offers that does not depend on its framework lives here once:
the compute dtype its couplings take from a sequence (``precision.py``) and
the residual stream's sharding (``sharding.py``).
"""
