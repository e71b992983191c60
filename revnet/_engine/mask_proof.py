"""The proof behind a masked coupling: a value equal to an unknown where a
known mask holds (:mod:`revnet._engine.masks`).

:func:`restrict` reads a value "where the mask holds", through the equations
that keep an unknown there (``u * m``, a select on the mask picking ``u``,
sums of such terms) and those that are zero there (a factor ``1 - m`` or
``~m``; with ``loose``, another known factor, then checked at run time).
Masks are compared by their :func:`root`, before casts and broadcasts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from revnet._engine import jaxpr as jx

ZERO = "zero"


@dataclasses.dataclass
class Proof:
    """What a proof used: its equations, the known values it assumes zero
    where the mask holds, and the values it found equal to an unknown there
    (innermost first)."""

    eqns: set = dataclasses.field(default_factory=set)
    zeros: set = dataclasses.field(default_factory=set)
    same: list = dataclasses.field(default_factory=list)


def masks(an: Any) -> list[int]:
    """The known values that mask an unknown one: a known operand of a ``mul``
    with an unknown one, or the known predicate of a ``select_n``."""
    found: list[int] = []
    for i, ins in enumerate(an.wiring.eqn_ins):
        name = jx.primitive_name(an.jaxpr.eqns[i])
        if name == "mul" and len(ins) == 2:
            cands = [a for a, b in (ins, ins[::-1]) if _unknown(an, b)]
        elif name == "select_n" and len(ins) == 3:
            cands = [ins[0]]
        else:
            continue
        for c in cands:
            if c is not None and an.is_known(c):
                r = root(an, c)
                if r not in found:
                    found.append(r)
    return found


def _unknown(an: Any, v: int | None) -> bool:
    return v is not None and not an.is_known(v)


def root(an: Any, v: int) -> int:
    """``v`` before casts (a boolean mask made a float one) and broadcasts
    that add leading axes (as NumPy broadcasts, so that the run-time check
    can compare the roots)."""
    while True:
        i = an.eqn_of.get(v)
        if i is None:
            return v
        eqn = an.jaxpr.eqns[i]
        (a, *_) = an.wiring.eqn_ins[i] or (None,)
        name = jx.primitive_name(eqn)
        if a is None or name not in ("convert_element_type", "broadcast_in_dim"):
            return v
        if name == "broadcast_in_dim":
            n_in, n_out = len(an.avals[a].shape), len(an.avals[v].shape)
            if tuple(eqn.params["broadcast_dimensions"]) != tuple(
                range(n_out - n_in, n_out)
            ):
                return v
        v = a


def _is(an: Any, v: int | None, mask: int) -> bool:
    return v is not None and root(an, v) == mask


def _complement(an: Any, v: int | None, mask: int, zeros: set | None) -> bool:
    """Whether ``v`` is zero (False) where the mask holds: ``1 - m`` or
    ``~m`` of the mask; with ``zeros`` (not None), also any other known value,
    which then joins ``zeros`` and is checked at run time (a complement
    computed before tracing is a constant of its own)."""
    if v is None or not an.is_known(v) or _is(an, v, mask):
        return False
    i = an.eqn_of.get(root(an, v))
    if i is not None:
        eqn, ins = an.jaxpr.eqns[i], an.wiring.eqn_ins[i]
        name = jx.primitive_name(eqn)
        if name == "not" and _is(an, ins[0], mask):
            return True
        one = eqn.invars[0] if eqn.invars else None
        if (
            name == "sub"
            and jx.is_literal(one)
            and float(jx.literal_value(one)) == 1.0
            and _is(an, ins[1], mask)
        ):
            return True
    if zeros is None:
        return False
    zeros.add(root(an, v))
    return True


def restrict(an, v, mask, pr: Proof, loose=False) -> int | str | None:
    """``v`` where the mask holds: an unknown value, :data:`ZERO`, or None
    (not shown), recorded in ``pr``.

    With ``loose``, a term of a sum beside one equal to an unknown may be
    zero by a known factor that is not the mask's complement on the
    program's face: it joins ``zeros``, checked at run time.
    """
    got = _restricted(an, v, mask, pr, loose)
    if isinstance(got, int):
        pr.same.append(v)
    return got


def _restricted(an, v, mask, pr: Proof, loose) -> int | str | None:
    if v is None:
        return None
    i = an.eqn_of.get(v)
    if i is None:
        return None if an.is_known(v) else v
    name = jx.primitive_name(an.jaxpr.eqns[i])
    ins = an.wiring.eqn_ins[i]
    got = None
    if name == "mul" and len(ins) == 2:
        for a, b in (ins, ins[::-1]):
            if _is(an, a, mask):
                got = restrict(an, b, mask, pr, loose)
            elif _complement(an, a, mask, None):
                got = ZERO
            if got is not None:
                break
    elif name == "add" and len(ins) == 2:
        got = _sum(an, ins, mask, pr, loose)
    elif name == "select_n" and len(ins) == 3 and _is(an, ins[0], mask):
        got = restrict(an, ins[2], mask, pr, loose)
    elif name == "select_n" and len(ins) == 3 and _complement(an, ins[0], mask, None):
        got = restrict(an, ins[1], mask, pr, loose)
    if got is not None:
        pr.eqns.add(i)
        return got
    return None if an.is_known(v) else v


def _sum(an, ins, mask, pr: Proof, loose) -> int | str | None:
    """``a + b`` where the mask holds."""
    terms = [restrict(an, x, mask, pr, loose) for x in ins]
    if ZERO in terms:
        return terms[1 - terms.index(ZERO)]
    if not loose:
        return None
    for n in (0, 1):
        other = ins[1 - n]
        j = an.eqn_of.get(other)
        if not isinstance(terms[n], int) or j is None:
            continue
        if jx.primitive_name(an.jaxpr.eqns[j]) != "mul":
            continue
        factors = an.wiring.eqn_ins[j]
        if any(_complement(an, f, mask, pr.zeros) for f in factors):
            pr.eqns.add(j)
            return terms[n]
    return None


def product(an: Any, i: int, u: int, mask: int) -> int | None:
    """The position of ``u`` in equation ``i`` when it is a mask product of
    ``u``: ``u * m`` or ``where(m, u, known)``."""
    name = jx.primitive_name(an.jaxpr.eqns[i])
    ins = an.wiring.eqn_ins[i]
    if name == "mul" and len(ins) == 2:
        for n, (a, b) in enumerate((ins, ins[::-1])):
            if a == u and _is(an, b, mask):
                return n
    if name == "select_n" and len(ins) == 3 and _is(an, ins[0], mask):
        if ins[2] == u and ins[1] is not None and an.is_known(ins[1]):
            return 2
    return None
