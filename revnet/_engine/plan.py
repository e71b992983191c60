"""Plans: the contract between the analysis and the interpreter.

A :class:`Plan` says how to rebuild a jaxpr's unknown inputs from its known
inputs and outputs. It refers to equations by index and to variables by their
position in the jaxpr's :class:`Wiring`, never to the
jaxpr's objects: a plan made for one trace applies to any trace of the same
structure, and the interpreter takes the equations, their params and rule
objects (a ``custom_vjp``'s backward, nested constants) from the jaxpr it is
given. Rules are named, and looked up in the registry when they run.

Each step produces some variables once the variables it reads are known:

========== ==================================================================
step       produces
========== ==================================================================
Forward    an equation's outputs, evaluated from its inputs (with its VJP)
Solve      an equation's unknown inputs, by its primitive's inverse rule
Custom     a ``custom_ivjp`` function's inputs, by the user's inverse
Call       a nested call's unknown inputs, by the plan of its body
Scan       a ``scan``'s initial carry (and unknown ``xs``), by a reversed scan
ScanAux    final carries of a scan computed forward (``fori_loop``'s counter)
Tile       a value from ``slice`` equations whose outputs cover it
Select     values rebuilt through ``select_n`` with a known predicate
========== ==================================================================

The analysis lists steps in a valid order and ``producer`` maps each variable
it makes known to its step; the interpreter runs steps on demand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from revnet._engine import jaxpr as jx


@dataclasses.dataclass(frozen=True)
class Wiring:
    """A jaxpr's variables numbered by position: the structure plans refer to.

    Inputs are ``0 .. len(invars) - 1``, then each equation's outputs in order.
    ``None`` stands for a literal among inputs and outputs, and for a dropped
    output of an equation. Two jaxprs of the same structure have equal wirings.
    """

    n_vars: int
    invars: tuple[int, ...]
    outvars: tuple[int | None, ...]
    eqn_ins: tuple[tuple[int | None, ...], ...]
    eqn_outs: tuple[tuple[int | None, ...], ...]


def wiring(jaxpr: Any) -> Wiring:
    """Numbers ``jaxpr``'s variables (see :class:`Wiring`)."""
    ids: dict = {}
    for v in jaxpr.invars:
        ids[v] = len(ids)
    eqn_ins, eqn_outs = [], []
    for e in jaxpr.eqns:
        eqn_ins.append(tuple(None if jx.is_literal(a) else ids[a] for a in e.invars))
        outs = []
        for a in e.outvars:
            if jx.is_dropvar(a):
                outs.append(None)
            else:
                ids[a] = len(ids)
                outs.append(ids[a])
        eqn_outs.append(tuple(outs))
    return Wiring(
        len(ids),
        tuple(range(len(jaxpr.invars))),
        tuple(None if jx.is_literal(a) else ids[a] for a in jaxpr.outvars),
        tuple(eqn_ins),
        tuple(eqn_outs),
    )


def var_avals(jaxpr: Any) -> list[Any]:
    """The abstract value of each variable, indexed as in :func:`wiring`."""
    out = [v.aval for v in jaxpr.invars]
    for e in jaxpr.eqns:
        out.extend(v.aval for v in e.outvars if not jx.is_dropvar(v))
    return out


@dataclasses.dataclass(frozen=True)
class Forward:
    eqn: int


@dataclasses.dataclass(frozen=True)
class Solve:
    """Equation ``eqn`` solved for its inputs ``unknown`` by the rule ``rule``."""

    eqn: int
    unknown: tuple[int, ...]
    rule: str


@dataclasses.dataclass(frozen=True)
class Custom:
    """A ``custom_ivjp`` function's equation, solved by its own inverse.

    ``n_const_leaves`` leading inputs (after ``n_hoisted`` hoisted ones) are
    the function's known constants; ``unknown`` are the rest. ``in_tree`` and
    ``out_tree`` are the pytrees the function was called with. ``remade``
    are constants that are not known, which the function makes again itself
    (a replaying call's decisions, not stored:
    :mod:`revnet._engine.decisions.ivjp_replay`).
    """

    eqn: int
    unknown: tuple[int, ...]
    n_hoisted: int
    n_const_leaves: int
    in_tree: Any
    out_tree: Any
    remade: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Call:
    """A nested call solved by ``plan``, the plan of its body.

    With ``custom`` (a ``custom_vjp``/``custom_jvp`` function) the body only
    rebuilds the inputs; cotangents come from the call's own rule.
    """

    eqn: int
    unknown: tuple[int, ...]
    plan: Plan
    custom: bool = False


@dataclasses.dataclass(frozen=True)
class Scan:
    """A ``scan`` run backwards; ``plan`` rebuilds the body's carry inputs."""

    eqn: int
    unknown: tuple[int, ...]
    plan: Plan
    known_xs: tuple[bool, ...]
    known_ys: tuple[bool, ...]


@dataclasses.dataclass(frozen=True)
class ScanAux:
    """Final values of scan carries that are computed forward.

    A carry whose initial value is known and whose update depends only on
    itself, the constants and known ``xs`` is run forward by a reduced scan
    (the body restricted to the outputs ``carry``, reading the body inputs
    ``in_idx``), so that the scan can then be run backwards.
    """

    eqn: int
    carry: tuple[int, ...]
    in_idx: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Tile:
    """Variable ``var`` assembled from the ``slice`` equations ``eqns``."""

    var: int
    eqns: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Select:
    """Variables ``vars`` rebuilt through the ``select_n`` equation ``eqn``.

    ``branches`` holds one ``(case, chain)`` entry per branch: ``case`` is the
    case's input position in the equation, and ``chain`` the position-wise
    solves ``(eqn, rule name, unknown input)`` back to values common to all
    branches. A chain entry names an elementwise primitive rule or a
    structural rule whose ``positionwise`` hook accepted the equation; a
    nested ``select_n`` with a known predicate splits the chain, as the entry
    ``(eqn, "select_n", case position)``, so one case may head several
    branches. Where the predicates pick a branch, its reconstruction is exact;
    the results are merged with the same predicates.

    An unknown predicate (``jnp.where(x > 0, x, 0.1 * x)``, leaky ReLU) that
    the equations ``pred_eqns`` compute from ``vars`` and known values is
    decided by consistency: each branch's candidate is kept where the
    predicate, evaluated on that candidate, picks that branch. For an
    injective select exactly one branch is consistent at each position.
    """

    eqn: int
    vars: tuple[int, ...]
    branches: tuple[tuple[int, tuple[tuple[int, str, int], ...]], ...]
    pred_eqns: tuple[int, ...] = ()


Step = Forward | Solve | Custom | Call | Scan | ScanAux | Tile | Select


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """How to rebuild a jaxpr's unknown inputs from its outputs.

    Attributes:
      wiring: the variables of the jaxpr it was made for, by position.
      known_in: which of the jaxpr's inputs are given.
      known_out: which of its outputs are given.
      steps: the steps, each producing some variables, in a valid order.
      producer: variable id -> index into ``steps``.
    """

    wiring: Wiring
    known_in: tuple[bool, ...]
    known_out: tuple[bool, ...]
    steps: tuple[Any, ...]
    producer: Mapping[int, int]
