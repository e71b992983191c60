"""A stack's plan: which layers store, which recompute, which invert.

A reversible stack stores nothing per layer and pays one more forward pass
of each layer; plain backprop stores each layer's residuals and pays
nothing; ``jax.checkpoint`` (remat) stores each layer's input and pays the
forward pass too. Where memory is to spare, storing is the fastest. A
:class:`StackPlan` says how many layers take each choice: the first
``store`` layers run under plain autodiff, the next ``remat`` under
``jax.checkpoint``, and the rest invert. Each group runs as its own scan, so
a plan with ``k`` stored layers holds ``k`` layers' residuals and no more.
"""

from __future__ import annotations

import dataclasses

from revnet._checks import check_int

STORE, REMAT, INVERT = "store", "remat", "invert"
CHOICES = (STORE, REMAT, INVERT)


@dataclasses.dataclass(frozen=True)
class StackPlan:
    """How many layers of a stack store, recompute (remat) or invert.

    Layers keep their order: the first ``store`` layers store their
    residuals as plain backprop does, the next ``remat`` layers store their
    input and are recomputed in the backward pass (``jax.checkpoint``), and
    the remaining layers are inverted, storing nothing. ``StackPlan()``
    inverts every layer (a reversible stack's default).

    Attributes:
      store: The number of layers that store their residuals.
      remat: The number of layers after them that store their input only.

    Example:

    >>> plan = revnet.StackPlan(store=2, remat=1)
    >>> plan.choices(5)
    ('store', 'store', 'remat', 'invert', 'invert')
    """

    store: int = 0
    remat: int = 0

    def __post_init__(self):
        for arg in ("store", "remat"):
            value = check_int("revnet.StackPlan", arg, getattr(self, arg), minimum=0)
            object.__setattr__(self, arg, value)

    def counts(self, depth: int, where: str = "StackPlan") -> tuple[int, int, int]:
        """``(store, remat, invert)`` for a stack of ``depth`` layers.

        Raises:
          ValueError: If the plan has more stored and recomputed layers than
            the stack has layers.
        """
        if self.store + self.remat > depth:
            raise ValueError(
                f"{where}: its plan stores {self.store} and recomputes "
                f"{self.remat} layers, more than its {depth} layers; give at most "
                f"{depth} in all (the rest invert)."
            )
        return self.store, self.remat, depth - self.store - self.remat

    def choices(self, depth: int) -> tuple[str, ...]:
        """The choice of each of ``depth`` layers, in order."""
        store, remat, invert = self.counts(depth)
        return (STORE,) * store + (REMAT,) * remat + (INVERT,) * invert
