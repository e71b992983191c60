"""revnet: reversible neural networks with invertible VJPs for JAX and Haiku."""

__version__ = "0.1.0"
