"""Affine forms: a value computed from unknowns, as a sum of unknown atoms
times polynomial coefficients in known values, plus a known part.

:class:`Forms` writes a stuck analysis's values this way through ``add``,
``sub``, ``neg``, a ``mul`` or ``div`` by a known value, and same-shape
conversions; any other equation on unknowns makes an *atom* (programs are
traced with duplicate equations merged, so ``sin(x)`` written twice is one
atom). Forms and polynomials past :data:`MAX_TERMS` terms are atoms too, so
that the work stays small on large programs. Coefficients are polynomials
in known values (``h``, ``1/m``) with float64 factors; each remembers the
magnitude of the terms it was summed from, and a sum that cancels to within
``tol`` of that magnitude is zero (:func:`clean`). :mod:`.elimination` solves
with them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from revnet._engine import jaxpr as jx

# A form with more atoms, or a polynomial with more monomials, is an atom.
MAX_TERMS = 24

_PASS = ("convert_element_type", "copy", "copy_p")

# A polynomial in known values: monomial -> coefficient. A monomial is a
# sorted tuple of factors, ``(var id, power)`` with power 1 or -1.
Poly = dict


class Forms:
    """Affine forms of the variables of one stuck analysis."""

    def __init__(self, an: Any, tol: float):
        self.an, self.tol = an, tol
        self.forms: dict[int, dict | None] = {}
        self.cones: dict[int, tuple[int, ...]] = {}
        self.polys: dict[int, Poly | None] = {}

    def clean(self, p: Poly) -> Poly:
        return clean(p, self.tol)

    def _eqn(self, v: int):
        i = self.an.eqn_of.get(v)
        return (None, None) if i is None else (i, self.an.jaxpr.eqns[i])

    def _operand(self, i: int, n: int):
        """``(var id, literal scalar)`` of input ``n`` of equation ``i``."""
        v = self.an.wiring.eqn_ins[i][n]
        if v is not None:
            return v, None
        value = np.asarray(jx.literal_value(self.an.jaxpr.eqns[i].invars[n]))
        if value.size != 1 or not np.isfinite(value).all():
            return None, None
        return None, Coef(float(value.reshape(())))

    def known_poly(self, v: int | None, literal: Coef | None = None):
        """A known value as a polynomial, or None."""
        if v is None:
            return None if literal is None else ({(): literal} if literal.v else {})
        if v in self.polys:
            return self.polys[v]
        self.polys[v] = {((v, 1),): ONE}  # an atom, unless decomposed
        i, eqn = self._eqn(v)
        if eqn is None:
            return self.polys[v]
        name = jx.primitive_name(eqn)
        ops = [self._operand(i, n) for n in range(len(eqn.invars))]
        polys = [self.known_poly(*o) if o != (None, None) else None for o in ops]
        out = None
        if name in ("add", "sub") and None not in polys:
            out = self.clean(plus(polys[0], polys[1], -1 if name == "sub" else 1))
        elif name == "mul" and None not in polys:
            out = self.clean(times(polys[0], polys[1]))
        elif name == "neg" and None not in polys:
            out = times(polys[0], {(): Coef(-1.0)})
        elif name in (*_PASS, "broadcast_in_dim") and polys[0] is not None:
            out = polys[0] if is_inexact(self.an.avals[v]) else None
        if out is not None and len(out) <= MAX_TERMS:
            self.polys[v] = out
        return self.polys[v]

    def _inverse(self, v: int | None, literal: Coef | None):
        if v is None:
            return (
                None if literal is None or not literal.v else {(): Coef(1 / literal.v)}
            )
        return {((v, -1),): ONE}

    def form(self, v: int, expand: bool = False) -> dict | None:
        """``v`` as ``{atom: polynomial}`` (``{}`` when known), or None.

        ``expand``: write a known ``v`` through its equation.
        """
        an = self.an
        if an.is_known(v) and not expand:
            return {}
        if v in self.forms and not expand:
            return self.forms[v]
        atom = {v: {(): ONE}}
        i, eqn = self._eqn(v)
        out, cone = atom, ()
        if eqn is not None and is_inexact(an.avals[v]):
            name = jx.primitive_name(eqn)
            ops = [self._operand(i, n) for n in range(len(eqn.invars))]
            got = self._expand(v, name, ops)
            if got is not None and len(got[0]) <= MAX_TERMS:
                out, inner = got
                cone = tuple(sorted({*inner, i}))
        if not expand:
            self.forms[v] = out
            self.cones[v] = cone
        return out if not expand else (out, cone)

    def _expand(self, v: int, name: str, ops: Sequence[tuple]):
        """``v``'s form and cone through its equation ``name``, or None."""
        shape = self.an.avals[v].shape
        if name in ("add", "sub"):
            parts = [self._part(o, shape) for o in ops]
            if None in parts:
                return None
            sign = -1 if name == "sub" else 1
            out = _combine(parts[0][0], parts[1][0], sign, self.tol)
            return out, parts[0][1] + parts[1][1]
        if name == "neg" or (name in _PASS and self._widening(ops[0], v)):
            part = self._part(ops[0], shape)
            if part is None:
                return None
            return _apply(part[0], {(): Coef(-1.0 if name == "neg" else 1.0)}), part[1]
        known = [o[0] is None or self.an.is_known(o[0]) for o in ops]
        if name == "mul" and known.count(False) == 1:
            u = known.index(False)
            factor = self.known_poly(*ops[1 - u])
        elif name == "div" and known == [False, True]:
            u, factor = 0, self._inverse(*ops[1])
        else:
            return None
        part = None if factor is None else self._part(ops[u], shape)
        if part is None:
            return None
        return _apply(part[0], factor), part[1]

    def _widening(self, op: tuple, v: int) -> bool:
        """Whether a conversion of ``op`` to ``v``'s type keeps every value
        (a float cast to a float type at least as wide): a narrowing cast
        loses digits and is left to the rules, which refuse it."""
        if op[0] is None or not is_inexact(self.an.avals[op[0]]):
            return False
        src, dst = self.an.avals[op[0]].dtype, self.an.avals[v].dtype
        return jnp.promote_types(src, dst) == dst

    def _part(self, op: tuple, shape: tuple):
        """An operand's form and cone: ``({}, ())`` when known."""
        v, _ = op
        if v is None or self.an.is_known(v):
            return {}, ()
        if self.an.avals[v].shape != shape:
            return None  # broadcast unknowns are left to propagation
        f = self.form(v)
        if f is None:
            return None
        return f, self.cones.get(v, ())


class Coef(NamedTuple):
    """A coefficient: its value, and the sum of the magnitudes of the terms it
    was computed from (a value below ``tol`` times that is a cancellation)."""

    v: float
    m: float = -1.0

    @property
    def mag(self) -> float:
        return abs(self.v) if self.m < 0 else self.m


ONE = Coef(1.0)


def clean(p: Poly, tol: float) -> Poly:
    return {k: c for k, c in p.items() if abs(c.v) > tol * c.mag}


def plus(a: Poly, b: Poly, sign: int = 1) -> Poly:
    out = dict(a)
    for k, c in b.items():
        o = out.get(k, Coef(0.0, 0.0))
        out[k] = Coef(o.v + sign * c.v, o.mag + c.mag)
    return out


def times(a: Poly, b: Poly) -> Poly:
    out: Poly = {}
    for ma, ca in a.items():
        for mb, cb in b.items():
            k = _monomial(ma + mb)
            o = out.get(k, Coef(0.0, 0.0))
            out[k] = Coef(o.v + ca.v * cb.v, o.mag + ca.mag * cb.mag)
    return out


def _monomial(factors: tuple) -> tuple:
    powers: dict = {}
    for v, p in factors:
        powers[v] = powers.get(v, 0) + p
    return tuple(sorted((v, p) for v, p in powers.items() if p))


def degree(p: Poly) -> int:
    return max((sum(abs(e) for _, e in m) for m in p), default=0)


def _combine(a: dict, b: dict, sign: int, tol: float) -> dict:
    out = {k: dict(v) for k, v in a.items()}
    for k, v in b.items():
        out[k] = clean(plus(out.get(k, {}), v, sign), tol)
    return {k: v for k, v in out.items() if v}


def _apply(form: dict, factor: Poly) -> dict:
    out = {k: times(v, factor) for k, v in form.items()}
    return {k: v for k, v in out.items() if v}


def frozen(p: Poly) -> tuple:
    return tuple(sorted((m, c.v) for m, c in p.items()))


def is_inexact(aval: Any) -> bool:
    return aval is not None and jnp.issubdtype(aval.dtype, jnp.inexact)
