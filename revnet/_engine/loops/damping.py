"""Damping visible at trace time: a factor an inverted step divides by.

A step that multiplies its carry by a factor of modulus below 1 (a damped
update, an absorbing boundary layer) is inverted by dividing by it, at every
reversed step: the rounding error of the rebuilt carry grows by its inverse,
geometrically in the number of steps. Where the plan solves a ``mul`` for its
unknown operand with the other known at trace time (a literal, or a constant
the body closes over) and below 1 in modulus, or a ``div`` for its numerator
with a known denominator above 1, the loop's ``mode="auto"`` does not invert
without the boundary check (:mod:`revnet._engine.boundary`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from revnet._engine import jaxpr as jx
from revnet._engine.plan import Plan, Solve


def visible_damping(jaxpr: Any, plan: Plan, consts: Sequence[Any]) -> str | None:
    """Where ``plan`` divides by a factor of modulus below 1 known at trace time.

    Args:
      jaxpr: the loop's body; its first ``len(consts)`` inputs are constants.
      plan: the plan rebuilding its carry.
      consts: the constants' values (tracers are not known at trace time).

    Returns:
      The equation's source line (``""`` when it has none), or None when no
      solved equation divides by such a factor.
    """
    values = dict(zip(jaxpr.invars, consts))
    for step in plan.steps:
        if not isinstance(step, Solve):
            continue
        eqn = jaxpr.eqns[step.eqn]
        name = jx.primitive_name(eqn)
        if name not in ("mul", "div") or len(step.unknown) != 1:
            continue
        (u,) = step.unknown
        if name == "div" and u != 0:
            continue
        factor = _known(eqn.invars[1 - u], values)
        if factor is None or factor.size == 0:
            continue
        modulus = np.abs(factor)
        if (name == "mul" and modulus.max() < 1) or (
            name == "div" and modulus.min() > 1
        ):
            return jx.where(eqn)
    return None


def _known(atom: Any, values: dict) -> np.ndarray | None:
    if jx.is_literal(atom):
        value = jx.literal_value(atom)
    else:
        value = values.get(atom)
    if value is None or isinstance(value, jax.core.Tracer):
        return None
    try:
        return np.asarray(value, dtype=np.complex128)
    except (TypeError, ValueError):
        return None
