"""Building equations: the decision pass (:mod:`revnet._engine.decisions`)
rewrites jaxprs with these, so that it never touches JAX's jaxpr classes itself;
:func:`restrict` cuts a loop body down to some of its outputs (the scan rule,
the choice of a loop's backward mode).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from revnet._engine.jaxpr.atoms import (
    Jaxpr,
    JaxprEqn,
    Literal,
    Var,
    is_dropvar,
    is_literal,
    struct,
)
from revnet._engine.jaxpr.bodies import Body
from revnet._engine.jaxpr.source import library_where, where


def with_outputs(jaxpr: Jaxpr, outvars: Sequence[Any], eqns=None) -> Jaxpr:
    """``jaxpr`` with the outputs ``outvars`` (and the equations ``eqns``)."""
    eqns = list(jaxpr.eqns) if eqns is None else list(eqns)
    return jaxpr.replace(eqns=eqns, outvars=list(outvars))


def splice(
    fun: Callable[..., Sequence[Any]], atoms: Sequence[Any], source_info: Any
) -> tuple[list[JaxprEqn], list[Any]]:
    """The equations computing ``fun(*atoms)``, on the variables ``atoms``.

    ``fun`` is traced on the atoms' abstract values; its equations are
    renamed onto fresh variables and attributed to ``source_info``.

    Returns:
      ``(equations, output atoms)``.
    """

    closed = jax.make_jaxpr(lambda *xs: list(fun(*xs)))(
        *[struct(v.aval) for v in atoms]
    )
    inner = closed.jaxpr
    env: dict = dict(zip(inner.invars, atoms))
    for cv, c in zip(inner.constvars, closed.consts):
        env[cv] = Literal(c, cv.aval)
    return _renamed(inner, env, lambda e: source_info)


def _renamed(jaxpr: Jaxpr, env: dict, info: Callable[[JaxprEqn], Any]):
    """``jaxpr``'s equations and outputs on the atoms ``env`` maps its inputs to.

    Other variables are renamed fresh; ``info(e)`` is each equation's new
    source info. Returns ``(equations, output atoms)``.
    """

    def rename(a):
        if is_literal(a) or is_dropvar(a):
            return a
        if a not in env:
            env[a] = Var(a.aval)
        return env[a]

    eqns = [
        e.replace(
            invars=[rename(a) for a in e.invars],
            outvars=[rename(a) for a in e.outvars],
            source_info=info(e),
        )
        for e in jaxpr.eqns
    ]
    return eqns, [rename(a) for a in jaxpr.outvars]


def remat_with_body(eqn: JaxprEqn, body: Jaxpr, outvars, more_ins=()) -> JaxprEqn:
    """The ``remat`` equation ``eqn`` with a new (constant-free) body and outputs.

    ``more_ins`` are further inputs, read by ``body``'s last inputs.
    """
    return eqn.replace(
        params={**eqn.params, "jaxpr": body},
        invars=[*eqn.invars, *more_ins],
        outvars=list(outvars),
    )


def with_inputs(jaxpr: Jaxpr, invars: Sequence[Any], eqns, outvars) -> Jaxpr:
    """``jaxpr`` with the inputs ``invars``, equations ``eqns`` and outputs."""
    eqns = list(eqns)
    effects = set()
    for e in eqns:
        effects |= set(e.effects)
    return jaxpr.replace(
        invars=list(invars), eqns=eqns, outvars=list(outvars), effects=effects
    )


def live_equations(eqns: Sequence[JaxprEqn], outvars, given) -> list[JaxprEqn]:
    """The equations of ``eqns`` that ``outvars`` need when ``given`` are inputs.

    An equation whose outputs are all given, unused or dropped is left out,
    unless it has effects.
    """
    given = {id(v) for v in given}
    live = {id(a) for a in outvars if not is_literal(a)}
    kept = []
    for e in reversed(list(eqns)):
        used = any(
            not is_dropvar(v) and id(v) in live and id(v) not in given
            for v in e.outvars
        )
        if used or e.effects:
            kept.append(e)
            live.update(id(a) for a in e.invars if not is_literal(a))
    return kept[::-1]


def restrict(jaxpr: Jaxpr, out_idx: Sequence[int]) -> tuple[Jaxpr, list[int]]:
    """The part of ``jaxpr`` that computes the outputs ``out_idx``.

    Returns:
      ``(sub, in_idx)``: ``sub`` has the inputs ``in_idx`` of ``jaxpr`` (the
      ones those outputs depend on, in order) and the outputs ``out_idx``.
    """
    outs = [jaxpr.outvars[i] for i in out_idx]
    need = {v for v in outs if not is_literal(v)}
    kept = []
    for e in reversed(jaxpr.eqns):
        if any(v in need for v in e.outvars if not is_dropvar(v)):
            kept.append(e)
            need.update(a for a in e.invars if not is_literal(a))
    in_idx = [n for n, v in enumerate(jaxpr.invars) if v in need]
    sub = jaxpr.replace(
        invars=[jaxpr.invars[n] for n in in_idx],
        outvars=outs,
        eqns=list(reversed(kept)),
        effects=jaxpr.effects,
    )
    return sub, in_idx


def inline_body(
    body: Body, atoms: Sequence[Any], source_info: Any
) -> tuple[list[JaxprEqn], list[Any]]:
    """A call's body as equations on the call's inputs ``atoms``.

    The body's constants become literals; its variables are renamed fresh.

    Returns:
      ``(equations, output atoms)``.
    """
    consts = [Literal(c, v.aval) for v, c in zip(body.jaxpr.invars, body.consts)]
    env: dict = dict(zip(body.jaxpr.invars, [*consts, *atoms]))
    return _renamed(
        body.jaxpr,
        env,
        lambda e: e.source_info if where(e) or library_where(e) else source_info,
    )
