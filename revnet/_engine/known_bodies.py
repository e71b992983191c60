"""Calls whose body is a library function revnet inverts in closed form.

For numerical stability some library functions read their input more than
once, so that no equation of their body has one unknown input. ``jnp.logaddexp``
(and ``jax.nn.softplus``, which is ``logaddexp(x, 0)``) computes
``max(a, b) + log1p(exp(-|a - b|))`` behind a NaN guard, yet with one operand
known it is a bijection of the other onto ``(b, inf)``:

    y = log(e^a + e^b)   gives   a = y + log(-expm1(b - y)),

with the log-determinant term ``log(dy/da) = a - y``.

A call is recognised by its body, not by its name: the body must be, equation
for equation, the body of the reference function traced at the same input
types (:func:`revnet._engine.fingerprint.structure`). The call's name only
picks which reference to trace. The cotangents come from the call's own
derivative rule at the rebuilt inputs, as for every other call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from revnet._engine import fingerprint, log_det, runtime_checks
from revnet._engine import jaxpr as jx
from revnet._engine.cache import LRU
from revnet._engine.interpreter import Handler, register_handler


def _logaddexp_inverse(y: Any, known: Any) -> Any:
    return y + jnp.log(-jnp.expm1(known - y))


@dataclasses.dataclass(frozen=True)
class _Reference:
    """A library function of two operands, invertible in either when the
    other is known: ``inverse(y, known)`` and ``term(x, y)``, the
    log-determinant term of the solved operand ``x``."""

    fun: Callable[..., Any]
    inverse: Callable[[Any, Any], Any]
    term: Callable[[Any, Any], Any]


_REFERENCES = {
    "logaddexp": _Reference(
        jnp.logaddexp, _logaddexp_inverse, lambda x, y: jnp.broadcast_to(x - y, x.shape)
    ),
}

_STRUCTURES = LRU(64)


@dataclasses.dataclass(frozen=True)
class KnownBody:
    """Operand ``unknown`` of call ``eqn`` solved by reference ``name``."""

    eqn: int
    unknown: tuple[int, ...]
    name: str


def recognise(an: Any, i: int, eqn: Any, ins: Any) -> tuple | None:
    """The step solving call ``i`` when its body is a known reference's and
    one of its two operands is known: ``(step, produced, eqns)``, else None."""
    name = jx.call_name(eqn)
    body = jx.call_body(eqn)
    if name not in _REFERENCES or body is None or body.consts:
        return None
    if len(eqn.invars) != 2 or len(eqn.outvars) != 1 or sum(ins) != 1:
        return None
    if _structure(name, eqn) != fingerprint.structure(body.jaxpr):
        return None
    unknown = ins.index(False)
    step = KnownBody(i, (unknown,), name)
    return step, [an.wiring.eqn_ins[i][unknown]], (i,)


def _structure(name: str, eqn: Any) -> Any:
    """The structure of the reference's body at ``eqn``'s input types."""
    avals = tuple(jx.aval_key(jx.aval(v)) for v in eqn.invars)
    key = (name, avals)
    found = _STRUCTURES.get(key)
    if found is None:
        found = _reference_structure(name, eqn)
        _STRUCTURES.put(key, found)
    return found


def _reference_structure(name: str, eqn: Any) -> Any:
    args = [
        jax.ShapeDtypeStruct(
            jx.aval(v).shape,
            jx.aval(v).dtype,
            weak_type=bool(getattr(jx.aval(v), "weak_type", False)),
        )
        for v in eqn.invars
    ]
    try:
        closed = jax.make_jaxpr(_REFERENCES[name].fun)(*args)
    except Exception:  # the reference does not take these types
        return ("none",)
    inner = jx.nested_jaxpr(closed)[0]
    if len(inner.eqns) != 1:
        return ("none",)
    body = jx.call_body(inner.eqns[0])
    if body is None or body.consts:
        return ("none",)
    return fingerprint.structure(body.jaxpr)


class _Handler(Handler):
    def run(self, it, step, out_cts):
        i = step.eqn
        (n,) = step.unknown
        y = it.read(it.wiring.eqn_outs[i][0])
        known = it.read_in(i, 1 - n)
        x = _REFERENCES[step.name].inverse(y, known)
        shape = jx.aval(it.jaxpr.eqns[i].invars[n]).shape
        x = jnp.broadcast_to(x, shape).astype(jx.aval(it.jaxpr.eqns[i].invars[n]).dtype)
        runtime_checks.record([x], [y, known], _OUT_OF_RANGE)
        it.set([it.wiring.eqn_ins[i][n]], [x])
        return None


_OUT_OF_RANGE = (
    "a value rebuilt through logaddexp is not finite: the output is not above "
    "the known operand (logaddexp(x, b) > b for every finite x)"
)


class _Terms(log_det.TermRule):
    def term(self, ev, step):
        i = step.eqn
        (n,) = step.unknown
        eqn = ev.jaxpr.eqns[i]
        x, y = ev.read_in(i, n), ev.read(ev.wiring.eqn_outs[i][0])
        t = _REFERENCES[step.name].term(x, y)
        return ev.reduce(t, jx.aval(eqn.invars[n]), eqn)


register_handler(KnownBody, _Handler())
log_det.register_term_rule(KnownBody, _Terms())
