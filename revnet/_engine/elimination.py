"""Linear elimination: unknowns solved from several equations together.

Propagation solves one equation for one unknown at a time. Some steps tie
their unknowns together linearly across equations, so that no equation alone
has a single unknown: reversible Heun's ``yhat1 = 2 y0 - yhat0 + h f0`` and
``y1 = y0 + h/2 (f0 + f1)`` have the unknowns ``y0``, ``yhat0`` and ``f0``
in both, yet ``yhat1 - 2 y1 = -yhat0 - h f1`` gives ``yhat0`` alone.

When propagation is stuck, :func:`eliminate` writes every known value that is
computed from unknowns by ``add``, ``sub``, ``neg``, a ``mul`` or ``div`` by a
known value, or a same-shape conversion as an *affine form*: a sum of unknown
*atoms* (unknown inputs, or outputs of other equations on unknowns) times
coefficients, plus a known part (:mod:`.linear_forms`). A coefficient is a
polynomial in known values (``h``, ``1/m``), compared symbolically: one that
cancels (``h - 2 * (h/2)``) cancels whatever ``h`` is at run time; numeric
factors cancel to within a few roundings of the program's least precise float
(Python constants such as ``0.5 * h * h`` are rounded to it before tracing).
Fraction-free Gaussian elimination then looks for a
combination of the forms in which one atom alone is left; that atom is
solved, and propagation goes on from it. The :class:`Eliminate` step
evaluates the combination at run time: each form's known part is its value
with the atoms set to zero.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from revnet._engine import jaxpr as jx
from revnet._engine import log_det, runtime_checks
from revnet._engine.interpreter import Handler, register_handler, run_cone
from revnet._engine.linear_forms import (
    ONE,
    Forms,
    clean,
    degree,
    frozen,
    is_inexact,
    plus,
    times,
)

# Forms with more atoms or equations than this are not eliminated (the search
# is cubic in them); a stuck step has a handful.
MAX_SIZE = 24


@dataclasses.dataclass(frozen=True)
class Eliminate:
    """The unknown ``var`` solved from the known values ``rows`` together.

    Attributes:
      var: the variable solved.
      rows: per known value used, ``(var id, eqns, weight)``: ``eqns`` compute
        it from the atoms (in order), ``weight`` its polynomial factor in the
        combination, as ``((monomial, numerator, denominator), ...)``.
      atoms: the unknown atoms the rows' forms read (zero in their known parts).
      avals: each atom's ``(shape, dtype)``.
      coefficient: ``var``'s polynomial coefficient in the combination.
      dtype: ``var``'s dtype.
    """

    var: int
    rows: tuple[tuple[int, tuple[int, ...], tuple], ...]
    atoms: tuple[int, ...]
    avals: tuple[tuple[tuple[int, ...], str], ...]
    coefficient: tuple
    dtype: str

    @property
    def eqn(self) -> int:
        """The equation computing the first known value used (named in
        messages)."""
        return self.rows[0][1][-1]


def eliminate(an: Any) -> tuple[Eliminate, list[int]] | None:
    """A step solving one unknown of the stuck analysis ``an`` by linear
    elimination, and the variables it produces; None when there is none."""
    try:
        return _eliminate(an)
    except RecursionError:  # a chain deeper than Python's stack: not solved
        return None


def _eliminate(an: Any) -> tuple[Eliminate, list[int]] | None:
    floats = [a for a in an.avals if is_inexact(a)]
    if not floats:
        return None
    # Coefficients are compared in float64: a cancellation leaves a few
    # roundings of the program's least precise float (Python constants such
    # as 0.5 * h * h are rounded to it before tracing).
    eps = max(float(jnp.finfo(a.dtype).eps) for a in floats)
    forms = Forms(an, 16 * eps)
    rows = []
    for i in range(len(an.jaxpr.eqns)):
        if an.done[i]:
            continue
        outs = an.wiring.eqn_outs[i]
        if len(outs) != 1 or outs[0] is None or not an.is_known(outs[0]):
            continue
        if all(an.ins_known(i)):
            continue
        got = forms.form(outs[0], expand=True)
        if got is None:
            continue
        form, cone = got
        if form and all(a != outs[0] for a in form):
            rows.append((outs[0], form, cone))
    if not rows:
        return None
    atoms = sorted({a for _, f, _ in rows for a in f})
    if len(atoms) > MAX_SIZE or len(rows) > MAX_SIZE:
        return None
    unknown_in = [
        v for v, k in zip(an.wiring.invars, an.known_in) if not k and v not in an.known
    ]
    targets = [a for a in atoms if a in unknown_in] + [
        a for a in atoms if a not in unknown_in
    ]
    for target in targets:
        found = _isolate(rows, atoms, target, forms.tol)
        if found is None:
            continue
        weights, coefficient = found
        used = [(rows[r][0], rows[r][2], frozen(w)) for r, w in enumerate(weights) if w]
        read = {a for r, w in enumerate(weights) if w for a in rows[r][1]}
        read = sorted(read)
        step = Eliminate(
            target,
            tuple(used),
            tuple(read),
            tuple(_shape_dtype(an.avals[a]) for a in read),
            frozen(coefficient),
            _shape_dtype(an.avals[target])[1],
        )
        return step, [target]
    return None


def _isolate(rows, atoms, target, tol):
    """Weights of ``rows`` whose combination leaves ``target`` alone, and its
    coefficient there; None when no combination does."""
    n = len(rows)
    others = [a for a in atoms if a != target]
    table = [
        {
            "coef": {a: dict(f.get(a, {})) for a in atoms},
            "weights": [({(): ONE} if r == s else {}) for s in range(n)],
        }
        for r, (_, f, _) in enumerate(rows)
    ]
    free = list(range(n))
    for col in others:
        pivots = [r for r in free if table[r]["coef"][col]]
        if not pivots:
            continue
        # a constant pivot first: it never vanishes at run time
        p = min(pivots, key=lambda r: (degree(table[r]["coef"][col]), r))
        free.remove(p)
        pc = table[p]["coef"][col]
        for r in free:
            rc = table[r]["coef"][col]
            if not rc:
                continue
            row = table[r]
            row["coef"] = {
                a: clean(
                    plus(times(pc, row["coef"][a]), times(rc, table[p]["coef"][a]), -1),
                    tol,
                )
                for a in atoms
            }
            row["weights"] = [
                plus(times(pc, w), times(rc, pw), -1)
                for w, pw in zip(row["weights"], table[p]["weights"])
            ]
    for r in free:
        row = table[r]
        if row["coef"][target] and not any(row["coef"][a] for a in others):
            return row["weights"], row["coef"][target]
    return None


def _shape_dtype(aval: Any) -> tuple[tuple[int, ...], str]:
    return tuple(aval.shape), np.dtype(aval.dtype).name


# -- the step at run time ---------------------------------------------------- #


def poly_value(it: Any, poly: tuple) -> Any:
    """The value of a frozen polynomial in known values (:func:`frozen`)."""
    total = None
    for monomial, c in poly:
        term = c
        for v, p in monomial:
            x = it.read(v)
            term = term * (x if p > 0 else 1 / x)
        total = term if total is None else total + term
    return total


class _EliminateHandler(Handler):
    def needs(self, it, step):
        ids = {v for v, _, _ in step.rows}
        for poly in [step.coefficient, *(w for _, _, w in step.rows)]:
            ids |= {v for m, _ in poly for v, _ in m}
        made = set(step.atoms)
        for _, cone, _ in step.rows:
            made |= {v for i in cone for v in it.wiring.eqn_outs[i]}
        for _, cone, _ in step.rows:
            ids |= {v for i in cone for v in it.wiring.eqn_ins[i] if v not in made}
        ids.discard(None)
        return sorted(ids)

    def run(self, it, step, out_cts):
        total = None
        for v, cone, weight in step.rows:
            given = it.read(v)
            rest = known_part(it, v, cone, step.atoms, step.avals)
            term = poly_value(it, weight) * (given - rest)
            total = term if total is None else total + term
        solved = total / poly_value(it, step.coefficient)
        solved = solved.astype(step.dtype)
        given = [it.read(v) for v, _, _ in step.rows]
        runtime_checks.record([solved], given, _DEGENERATE)
        it.set([step.var], [solved])
        return None


_DEGENERATE = (
    "a value solved from several equations together is not finite: the "
    "coefficient it is divided by is zero at run time"
)


def known_part(
    it: Any, v: int, cone: Sequence[int], atoms: Sequence[int], avals: Sequence[tuple]
) -> Any:
    """The value of ``v`` computed by ``cone`` with the ``atoms`` (of
    ``(shape, dtype)`` ``avals``) set to zero: an affine form's known part."""
    env = {a: jnp.zeros(shape, dtype) for a, (shape, dtype) in zip(atoms, avals)}
    return run_cone(it.jaxpr, it.wiring, cone, env, it.read_in)[v]


class _Terms(log_det.TermRule):
    """One value solved from one known value of the same shape, elementwise
    (``y = c x + k`` with ``x`` read more than once): ``log|dy/dx|``.
    Log-determinants through unknowns solved together are not derived."""

    def has_terms(self, step, eqn):
        return True

    def term(self, ev, step):
        (given, cone, _), *more = step.rows
        aval = jx.aval(ev.jaxpr.eqns[cone[-1]].outvars[0]) if cone else None
        if more or step.atoms != (step.var,) or tuple(aval.shape) != step.avals[0][0]:
            raise log_det.refusal(
                ev.jaxpr.eqns[step.eqn],
                "its unknowns are solved together with other equations' (linear "
                "elimination), and revnet derives no log-determinant through that",
            )
        shape, dtype = step.avals[0]
        aval = jax.ShapeDtypeStruct(shape, dtype)
        return log_det.elementwise_term(ev, step.var, given, cone, aval)


register_handler(Eliminate, _EliminateHandler())
log_det.register_term_rule(Eliminate, _Terms())
