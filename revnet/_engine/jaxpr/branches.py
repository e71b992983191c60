"""``cond`` and ``while`` equations: their bodies, and a ``cond`` rebuilt."""

from __future__ import annotations

from collections.abc import Sequence

from revnet._engine.jaxpr.atoms import Jaxpr, JaxprEqn
from revnet._engine.jaxpr.bodies import Body, as_body, closed


def cond_branches(eqn: JaxprEqn) -> tuple[Body, ...] | None:
    """The branches of a ``cond`` equation (inputs: the operands), or None."""
    if eqn.primitive.name != "cond":
        return None
    return tuple(as_body(b) for b in eqn.params["branches"])


def cond_with_branches(
    eqn: JaxprEqn, branches: Sequence[tuple[Jaxpr, int]], invars, outvars
) -> JaxprEqn:
    """The ``cond`` equation ``eqn`` with new branches, inputs and outputs.

    Each branch is ``(jaxpr, n)``: its first ``n`` inputs are its constants,
    whose values are those of the same branch of ``eqn``.
    """
    new = tuple(
        closed(body, n, as_body(old).consts)
        for (body, n), old in zip(branches, eqn.params["branches"])
    )
    return eqn.replace(
        params={**eqn.params, "branches": new},
        invars=list(invars),
        outvars=list(outvars),
    )


def while_bodies(eqn: JaxprEqn) -> tuple[Body, int, Body, int] | None:
    """``(cond body, its number of constants, body, its number of constants)``
    of a ``while`` equation (constants lead the equation's inputs), or None."""
    if eqn.primitive.name != "while":
        return None
    p = eqn.params
    return (
        as_body(p["cond_jaxpr"]),
        int(p["cond_nconsts"]),
        as_body(p["body_jaxpr"]),
        int(p["body_nconsts"]),
    )


__all__ = ["cond_branches", "cond_with_branches", "while_bodies"]
