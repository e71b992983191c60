"""The records of the decision pass: what it stores, and what one pass made."""

from __future__ import annotations

import dataclasses

# The names of revnet.marks' marks (custom_jvp identities of one boolean).
DECISION_MARK = "revnet_decision"
KINK_MARK = "revnet_kink"


@dataclasses.dataclass(frozen=True)
class Kept:
    """One value the forward pass stores for the backward pass.

    Attributes:
      reason: ``"decision"`` (a result that jumps, or what decides it),
        ``"kink"`` (the branch of a kink, with ``kinks="store"``) or
        ``"inputs"`` (an equation's rebuilt inputs, at which the backward
        pass evaluates it).
      primitive: the primitive of the equation it is kept for.
      where: the user's source line of that equation, or ``""``.
      within: the loops and calls it sits in, outermost first (``"scan"``,
        ``"checkpoint"``, ``"cond"``); a ``scan`` stacks it once per step.
      call: the function a call equation wraps (``relu``), or ``""``.
    """

    reason: str
    primitive: str
    where: str
    within: tuple[str, ...] = ()
    call: str = ""

    @property
    def label(self) -> str:
        """The equation for messages: ``"`custom_jvp_call` (relu)"``."""
        return f"`{self.primitive}`" + (f" ({self.call})" if self.call else "")


@dataclasses.dataclass
class Result:
    """What one pass over a jaxpr made: its rewritten equations, the
    equations the forward pass runs (deciding calls fused), its outputs, the
    stored values with their records, and which outputs are rebuilt."""

    eqns: list
    fused: list
    outvars: list
    extra: list
    kept: list
    tout: list
