"""Marks that say how a select's predicate is treated on rebuilt values.

revnet classes a select from the program (:mod:`revnet._engine.decisions.continuity`):
one whose cases agree where its predicate switches (``leaky_relu``'s
``where(x >= 0, x, 0.01 * x)``) is a kink and is recomputed; one it cannot
prove continuous keeps its predicate stored. Wrap a predicate in
:func:`decision` or :func:`kink` to say it yourself.
"""

from __future__ import annotations

from typing import Any

import jax

from revnet._engine import DECISION_MARK, KINK_MARK

__all__ = ["decision", "kink"]


def _identity(name: str) -> Any:
    def fun(pred):
        return pred

    fun.__name__ = name
    marked = jax.custom_jvp(fun)
    marked.defjvp(lambda primals, tangents: (marked(primals[0]), tangents[0]))
    return marked


_decision = _identity(DECISION_MARK)
_kink = _identity(KINK_MARK)


def decision(pred: Any) -> Any:
    """Marks ``pred`` as a decision: it is stored when it reads rebuilt values.

    Use it for a select that revnet would take for a kink (its cases agree at
    the switching point) but whose derivative you need exactly as the forward
    pass made it, or for any comparison you want stored. It returns ``pred``.

    Example::

        y = jnp.where(revnet.decision(x > 0), x, 0.01 * x)

    Args:
      pred: a boolean array (a comparison).

    Returns:
      ``pred``, marked.
    """
    return _decision(pred)


def kink(pred: Any) -> Any:
    """Marks ``pred`` as a kink's switch: recomputed on rebuilt values.

    Use it for a select that is continuous where ``pred`` switches but that
    revnet cannot prove so (a threshold that is a weight, cases that read
    other values). Nothing is stored for it; at an exact tie its derivative
    follows the rebuilt value, as for ``relu``. With ``kinks="store"`` it is
    stored like every kink. Marking a real jump as a kink gives wrong
    gradients near a tie. It returns ``pred``.

    Example::

        y = jnp.where(revnet.kink(x > t), x, t)   # max(x, t), t a weight

    Args:
      pred: a boolean array (a comparison).

    Returns:
      ``pred``, marked.
    """
    return _kink(pred)
