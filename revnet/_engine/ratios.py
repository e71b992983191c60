"""Ratios: an unknown solved from a quotient of two affine forms of it.

Propagation solves an equation for one unknown input. A quotient whose
numerator and denominator both depend on the same unknown ``u`` has two
unknown inputs, yet it is a Möbius map of ``u``, which is invertible:

    q = (a u + b) / (c u + d)   gives   u = (b - q d) / (q c - a),

where ``a`` and ``c`` are polynomial coefficients in known values and ``b``
and ``d`` known parts (the forms with ``u`` set to zero, as in
:mod:`.elimination`). Logit is written this way (``log(u / (1 - u))``, which
``jax.scipy.special.logit`` computes), and so is a difference of logarithms
of two such forms, ``k log(a u + b) - k log(c u + d)`` (``log(u) -
log1p(-u)``): when stuck, :func:`solve_ratio` looks for either, with the
quotient's value known, and solves ``u`` from it. The map is invertible where
``a d - b c`` is not zero; where it is, the rebuilt value is not finite and
the run-time checks report it.

The log-determinant term is ``log|dq/du|`` (of the known value read, with
respect to ``u``), derived by differentiating the equations between them:
they are elementwise in ``u``.
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
from revnet._engine.elimination import known_part, poly_value
from revnet._engine.interpreter import Handler, register_handler, run_cone
from revnet._engine.linear_forms import Forms, frozen, is_inexact

# The equations whose output is the logarithm of their input's form: ``log1p``
# is the logarithm of one more than it.
_LOGS = {"log": 0.0, "log1p": 1.0}


@dataclasses.dataclass(frozen=True)
class Ratio:
    """The unknown ``var`` solved from a known quotient of two forms of it.

    Attributes:
      var: the variable solved (the forms' one atom).
      given: the known value read: the quotient, or ``k`` times the difference
        of the logarithms of the two forms plus a known part.
      eqn: the equation computing ``given`` (named in messages).
      parts: per form (numerator, denominator), ``(var, cone, coefficient,
        shift)``: the form's variable, the equations computing it from ``var``,
        ``var``'s polynomial coefficient in it, and the constant added to it
        (1 for the argument of ``log1p``).
      log: None for a quotient; for a difference of logarithms ``(k, cone,
        atoms)``: the factor, the equations computing ``given`` from the two
        logarithms, and the logarithms.
      cone: every equation from ``var`` to ``given``, in order.
      aval: ``var``'s ``(shape, dtype)``.
    """

    var: int
    given: int
    eqn: int
    parts: tuple[tuple[int, tuple[int, ...], tuple, float], ...]
    log: tuple[float, tuple[int, ...], tuple[int, ...]] | None
    cone: tuple[int, ...]
    aval: tuple[tuple[int, ...], str]


def solve_ratio(an: Any) -> tuple[Ratio, list[int]] | None:
    """A step solving one unknown of the stuck analysis ``an`` from a known
    quotient of two affine forms of it, and the variable it produces; None
    when there is none."""
    try:
        return _solve_ratio(an)
    except RecursionError:  # a chain deeper than Python's stack: not solved
        return None


def _solve_ratio(an: Any) -> tuple[Ratio, list[int]] | None:
    floats = [a for a in an.avals if is_inexact(a)]
    if not floats:
        return None
    eps = max(float(jnp.finfo(a.dtype).eps) for a in floats)
    forms = Forms(an, 16 * eps)
    for i, eqn in enumerate(an.jaxpr.eqns):
        outs = an.wiring.eqn_outs[i]
        if an.done[i] or len(outs) != 1 or not an.is_known(outs[0]):
            continue
        if all(an.ins_known(i)) or not is_inexact(an.avals[outs[0]]):
            continue
        found = _quotient(an, forms, i, eqn) or _log_difference(an, forms, i)
        if found is not None:
            return found, [found.var]
    return None


def _quotient(an: Any, forms: Forms, i: int, eqn: Any) -> Ratio | None:
    """``q = N / D`` with both forms of one unknown atom."""
    if jx.primitive_name(eqn) != "div":
        return None
    num, den = an.wiring.eqn_ins[i]
    parts = _parts(an, forms, [(num, 0.0), (den, 0.0)])
    if parts is None:
        return None
    var, parts = parts
    cone = tuple(sorted({*parts[0][1], *parts[1][1], i}))
    return Ratio(var, an.wiring.eqn_outs[i][0], i, parts, None, cone, _aval(an, var))


def _log_difference(an: Any, forms: Forms, i: int) -> Ratio | None:
    """``y = k log N - k log D + known`` with both forms of one unknown atom."""
    y = an.wiring.eqn_outs[i][0]
    got = forms.form(y, expand=True)
    if got is None or len(got[0]) != 2:
        return None
    form, cone = got
    atoms = sorted(form)
    factors = []
    for a in atoms:
        poly = form[a]
        if set(poly) != {()}:
            return None  # a coefficient of known values: not a constant
        factors.append(poly[()].v)
    if abs(factors[0] + factors[1]) > forms.tol * abs(factors[0]):
        return None  # not a difference of logarithms with one factor
    logs = []
    for a in atoms:
        j = an.eqn_of.get(a)
        if j is None or jx.primitive_name(an.jaxpr.eqns[j]) not in _LOGS:
            return None
        shift = _LOGS[jx.primitive_name(an.jaxpr.eqns[j])]
        logs.append((an.wiring.eqn_ins[j][0], shift, j))
    if factors[0] < 0:  # the numerator is the logarithm with factor +k
        logs.reverse()
    parts = _parts(an, forms, [(v, s) for v, s, _ in logs])
    if parts is None:
        return None
    var, parts = parts
    k = abs(factors[0])
    inner = {*parts[0][1], *parts[1][1], logs[0][2], logs[1][2]}
    log = (k, tuple(cone), tuple(atoms))
    return Ratio(var, y, i, parts, log, tuple(sorted({*inner, *cone})), _aval(an, var))


def _parts(an: Any, forms: Forms, ops: Sequence[tuple[int | None, float]]):
    """``(atom, parts)`` when each operand ``(var, shift)`` is an unknown of
    the output's shape whose form has one atom, the same for both."""
    parts, atom = [], None
    for v, shift in ops:
        if v is None or an.is_known(v) or not is_inexact(an.avals[v]):
            return None
        form = forms.form(v)
        if form is None or len(form) != 1:
            return None
        (a,) = form
        if an.is_known(a) or (atom is not None and a != atom):
            return None
        if an.avals[a].shape != an.avals[v].shape:
            return None
        atom = a
        parts.append((v, tuple(forms.cones.get(v, ())), frozen(form[a]), shift))
    if _constant(an, atom, parts):
        return None
    return atom, tuple(parts)


def _constant(an: Any, atom: int, parts: Sequence[tuple]) -> bool:
    """Whether the quotient is known at trace time not to depend on ``atom``
    somewhere (``a d - b c`` is zero: ``2 u / u``). Decided when the
    coefficients are numbers and the known parts are computed from literals
    and trace-time values only; otherwise the run-time checks report it."""
    found = []
    for v, cone, coefficient, shift in parts:
        if any(monomial for monomial, _ in coefficient):
            return False
        known = _static_known_part(an, v, cone, atom)
        if known is None:
            return False
        found.append((sum(c for _, c in coefficient), known + shift))
    (a, b), (c, d) = found
    scale = np.abs(a * d) + np.abs(b * c)
    return bool(np.any(np.abs(a * d - b * c) <= 1e-6 * scale))


class _NotStatic(Exception):
    """An input of a cone is not a trace-time value."""


def _static_known_part(an: Any, v: int, cone: Sequence[int], atom: int):
    """The known part of ``v`` (its value with ``atom`` zero) at trace time,
    or None when an input of ``cone`` is not a trace-time value."""
    aval = an.avals[atom]

    def outside(i: int, n: int):
        x = an.static_value(i, n)
        if x is None:
            raise _NotStatic
        return x

    env = {atom: np.zeros(aval.shape, aval.dtype)}
    try:
        with jax.ensure_compile_time_eval():
            env = run_cone(an.jaxpr, an.wiring, cone, env, outside)
    except _NotStatic:
        return None
    return np.asarray(env[v], np.float64)


def _aval(an: Any, v: int) -> tuple[tuple[int, ...], str]:
    aval = an.avals[v]
    return tuple(aval.shape), np.dtype(aval.dtype).name


# -- the step at run time ---------------------------------------------------- #


def _quotient_value(it: Any, step: Ratio) -> Any:
    """The known quotient ``N / D`` (for a difference of logarithms, the
    exponential of the difference divided by its factor)."""
    q = it.read(step.given)
    if step.log is None:
        return q
    k, cone, atoms = step.log
    rest = known_part(it, step.given, cone, atoms, [step.aval] * len(atoms))
    return jnp.exp((q - rest) / k)


class _RatioHandler(Handler):
    def needs(self, it, step):
        ids = {step.given}
        for _, _, coefficient, _ in step.parts:
            ids |= {v for m, _ in coefficient for v, _ in m}
        made = {step.var}
        made |= {v for i in step.cone for v in it.wiring.eqn_outs[i]}
        ids |= {v for i in step.cone for v in it.wiring.eqn_ins[i] if v not in made}
        ids.discard(None)
        return sorted(ids)

    def run(self, it, step, out_cts):
        shape, dtype = step.aval
        q = _quotient_value(it, step)
        (a, b), (c, d) = (
            (
                poly_value(it, coefficient),
                known_part(it, v, cone, [step.var], [step.aval]) + shift,
            )
            for v, cone, coefficient, shift in step.parts
        )
        solved = ((b - q * d) / (q * c - a)).astype(dtype)
        solved = jnp.broadcast_to(solved, shape)
        runtime_checks.record([solved], [it.read(step.given)], _DEGENERATE)
        it.set([step.var], [solved])
        return None


_DEGENERATE = (
    "a value solved from a quotient of two forms of it is not finite: the "
    "quotient does not depend on it there (a d - b c is zero), or the quotient "
    "is outside the map's range"
)


class _RatioTerms(log_det.TermRule):
    """``log|d given / d var|``, elementwise, from the forward values."""

    def term(self, ev, step):
        aval = jax.ShapeDtypeStruct(*step.aval)
        return log_det.elementwise_term(ev, step.var, step.given, step.cone, aval)


register_handler(Ratio, _RatioHandler())
log_det.register_term_rule(Ratio, _RatioTerms())
