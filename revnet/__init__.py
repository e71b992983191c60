"""revnet: reversible neural networks with invertible VJPs for JAX and Haiku."""

from revnet import rules  # noqa: F401  (registers the built-in inverse rules)
from revnet._engine import NotInvertibleError, register_inverse
from revnet._engine.checks import set_runtime_checks
from revnet.drift import DriftError, DriftMonitor, DriftReading, DriftWarning
from revnet.invertible import inverse, invertible
from revnet.ivjp import custom_ivjp
from revnet.loops import scan, while_loop

__version__ = "0.1.0"

__all__ = [
    "DriftError",
    "DriftMonitor",
    "DriftReading",
    "DriftWarning",
    "NotInvertibleError",
    "custom_ivjp",
    "inverse",
    "invertible",
    "register_inverse",
    "scan",
    "set_runtime_checks",
    "while_loop",
]
