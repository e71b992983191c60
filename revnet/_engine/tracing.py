r"""Tracing a function to the jaxpr the analysis reads.

:func:`trace` closure-converts a function to an open jaxpr whose inputs are its
closed-over values followed by its arguments, then prepares it: nested
``jit``\ s without constants are inlined (an inverse may need equations on
both sides of the boundary), dropped ``scan`` outputs get a variable, and
duplicate equations are merged. None of these passes changes what is
computed. The jaxpr objects themselves are reached through :mod:`.jaxpr`,
which prepares nested bodies with :func:`prepare` once this module is imported.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from revnet._engine import jaxpr as jx


def trace(fun: Callable[..., Any], args: Sequence[Any]) -> tuple[Any, list, Any]:
    """Traces ``fun(*args)`` (flat arrays) to an open jaxpr plus its consts.

    Returns:
      ``(jaxpr, consts, out_tree)``; ``jaxpr.invars`` are the consts' variables
      followed by the arguments' variables, and ``jaxpr.constvars`` is empty.
      ``consts`` holds every closed-over value, possibly tracers of an outer
      transformation or integer arrays (keys, counters).
    """
    jaxpr, _, consts, out_tree = trace_program(fun, args)
    return jaxpr, consts, out_tree


def trace_program(
    fun: Callable[..., Any], args: Sequence[Any]
) -> tuple[Any, Any, list, Any]:
    """``(jaxpr, program, consts, out_tree)``: :func:`trace`'s results, and the
    open jaxpr as traced (``program``), before :func:`prepare`.

    The analysis reads ``jaxpr``; a call batched by ``jax.vmap`` evaluates
    ``program``, in which revnet's own nested calls are still calls that
    batch themselves (:mod:`.jaxpr.vmappable`).
    """
    closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*args)
    out_tree = jax.tree_util.tree_structure(out_shape)
    jaxpr = closed.jaxpr
    consts = list(closed.consts)
    open_jaxpr = jaxpr.replace(
        constvars=[], invars=list(jaxpr.constvars) + list(jaxpr.invars)
    )
    return prepare(open_jaxpr), open_jaxpr, consts, out_tree


def prepare(jaxpr: Any) -> Any:
    """Inlines jits, names dropped scan outputs and merges duplicate equations.

    JAX_SCAN3's scans over carry refs are first turned back into ``scan`` equations
    (:func:`.jaxpr.lower_refs`).

    Nested bodies (:func:`.jaxpr.call_body`) are prepared the same way.
    """
    return cse(_name_scan_outputs(inline_jits(jx.lower_refs(jaxpr))))


def inline_jits(jaxpr: Any) -> Any:
    """Replaces nested ``jit`` (and ``eval_jaxpr``) equations without constants
    by their bodies, a ``cond`` on a literal index (diffrax's ``made_jump=False``)
    by the branch it runs,
    and revnet's own calls (:mod:`.jaxpr.vmappable`) by their custom VJPs.

    ``jnp`` functions are jits (``jnp.where`` is a jit around ``select_n``), and
    inverting them may need equations on both sides of the boundary. Inlining
    does not change what is computed.
    """

    def target(e):
        """``(body, operands)`` that ``e`` runs, when it is inlined."""
        if jx.hi_kind(e) == jx.REVNET_CALL:  # revnet's own call: its custom VJP
            body = jx.call_body(e)
            return None if body.consts else (body.jaxpr, e.invars)
        branches = jx.cond_branches(e)
        if branches is not None:  # a cond on a literal index runs one branch
            index = e.invars[0]
            if not isinstance(index, jx.Literal):
                return None
            chosen = branches[int(jx.literal_value(index))]
            return None if chosen.consts else (chosen.jaxpr, e.invars[1:])
        body = jx.plain_call_jaxpr(e)
        if body is None or jx.closed_consts(body):
            return None
        return jx.call_body(e).jaxpr, e.invars

    def inlinable(e):
        return target(e) is not None

    if not any(inlinable(e) for e in jaxpr.eqns):
        return jaxpr
    sub: dict = {}

    def outer(a):
        return a if isinstance(a, jx.Literal) else sub.get(a, a)

    eqns = []
    for e in jaxpr.eqns:
        if not inlinable(e):
            eqns.append(e.replace(invars=[outer(a) for a in e.invars]))
            continue
        body, operands = target(e)
        inner = inline_jits(body)
        env = {bv: outer(ov) for bv, ov in zip(inner.invars, operands)}

        def rename(a, env=env):
            if isinstance(a, jx.Literal) or jx.is_dropvar(a):
                return a
            if a not in env:
                env[a] = jx.Var(a.aval)
            return env[a]

        for ie in inner.eqns:
            # Equations of JAX's code (``jnp.sort``) carry only JAX's frames:
            # they are attributed to the user's call of the inlined function.
            # Those of another package keep their own, which name its line.
            own = jx.where(ie) or jx.library_where(ie)
            info = ie.source_info if own else e.source_info
            eqns.append(
                ie.replace(
                    invars=[rename(a) for a in ie.invars],
                    outvars=[rename(a) for a in ie.outvars],
                    source_info=info,
                )
            )
        for ov, bo in zip(e.outvars, inner.outvars):
            if not jx.is_dropvar(ov):
                sub[ov] = rename(bo)
    return jaxpr.replace(eqns=eqns, outvars=[outer(a) for a in jaxpr.outvars])


def _name_scan_outputs(jaxpr: Any) -> Any:
    """Gives dropped outputs of ``scan`` equations a variable.

    ``fori_loop`` drops its final counter; naming it lets the analysis compute
    it forward and then run the loop backwards from it.
    """
    if not any(
        e.primitive.name == "scan" and any(jx.is_dropvar(v) for v in e.outvars)
        for e in jaxpr.eqns
    ):
        return jaxpr
    eqns = []
    for e in jaxpr.eqns:
        if e.primitive.name == "scan":
            outs = [jx.Var(v.aval) if jx.is_dropvar(v) else v for v in e.outvars]
            e = e.replace(outvars=outs)
        eqns.append(e)
    return jaxpr.replace(eqns=eqns)


def cse(jaxpr: Any) -> Any:
    """Merges equations that compute the same thing from the same inputs.

    ``x[:, 2:]`` written twice is two ``slice`` equations; once merged, knowing
    one output means knowing the other. Equations with effects, and those
    whose params cannot be compared, are kept as they are.
    """
    seen: dict = {}
    sub: dict = {}
    eqns = []

    def outer(a):
        return a if isinstance(a, jx.Literal) else sub.get(a, a)

    for e in jaxpr.eqns:
        e = e.replace(invars=[outer(a) for a in e.invars])
        key = _eqn_key(e)
        hit = seen.get(key) if key is not None else None
        if hit is not None:
            for ov, hv in zip(e.outvars, hit.outvars):
                if not jx.is_dropvar(ov):
                    sub[ov] = hv
            continue
        if key is not None and not any(jx.is_dropvar(v) for v in e.outvars):
            seen[key] = e
        eqns.append(e)
    if not sub:
        return jaxpr
    return jaxpr.replace(eqns=eqns, outvars=[outer(a) for a in jaxpr.outvars])


def _eqn_key(e: Any) -> Any:
    if e.effects:
        return None
    try:
        params = tuple(sorted(e.params.items()))
        ins = tuple(
            ("lit", jx.literal_key(a)) if isinstance(a, jx.Literal) else a
            for a in e.invars
        )
        key = (e.primitive.name, ins, params)
        hash(key)
    except TypeError:
        return None
    return key


# Nested bodies (:func:`.jaxpr.as_body`) are prepared by the same passes; the
# jaxpr package is a leaf, so it is handed them here rather than importing them.
jx.set_prepare(prepare)
