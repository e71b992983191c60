"""Running single equations, and evaluating a function equation by equation."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from revnet._engine.jaxpr.atoms import JaxprEqn, is_dropvar, is_literal


def _bind_args(eqn: JaxprEqn) -> tuple[tuple, dict[str, Any]]:
    """``(subfuns, params)`` that ``eqn``'s primitive is bound with."""
    params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(params, tuple):  # jax < 0.10: (subfuns, params)
        return tuple(params[0]), dict(params[1])
    return (), dict(params)


def bind(eqn: JaxprEqn, *args: Any) -> list[Any]:
    """Runs one equation on ``args``; always returns a list of outputs."""
    prim = eqn.primitive
    subfuns, params = _bind_args(eqn)
    with eqn.ctx.manager:
        out = prim.bind(*subfuns, *args, **params)
    return list(out) if prim.multiple_results else [out]


def context(eqn: JaxprEqn) -> Any:
    """The context ``eqn`` was traced in (its abstract mesh among others), as
    a context manager: an inverse rule runs in it as the equation would."""
    return eqn.ctx.manager


def bind_params(eqn: JaxprEqn) -> dict[str, Any]:
    """The keyword arguments ``eqn``'s primitive is bound with."""
    return _bind_args(eqn)[1]


def eval_with(
    fun: Callable[..., Any],
    args: Sequence[Any],
    override: Callable[[str, dict[str, Any], list[Any]], list[Any] | None],
) -> list[Any]:
    """Traces ``fun(*args)`` and evaluates it, letting ``override`` run equations.

    ``override(primitive_name, params, ins)`` returns an equation's outputs, or
    None to bind the equation as it is. Only top-level equations are offered
    to it (a nested call is bound whole).
    """
    closed = jax.make_jaxpr(fun)(*args)
    jaxpr, env = closed.jaxpr, {}

    def read(v):
        return v.val if is_literal(v) else env[v]

    for v, c in zip(jaxpr.constvars, closed.consts):
        env[v] = c
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    for e in jaxpr.eqns:
        ins = [read(v) for v in e.invars]
        outs = override(e.primitive.name, bind_params(e), ins)
        if outs is None:
            outs = bind(e, *ins)
        for v, o in zip(e.outvars, outs):
            if not is_dropvar(v):
                env[v] = o
    return [read(v) for v in jaxpr.outvars]
