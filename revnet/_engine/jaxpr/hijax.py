"""JAX's "hijax" primitives (jax 0.10, behind JAX_CUSTOM_VJP3, JAX_REMAT3 and
JAX_SCAN3), seen as ordinary calls and scans.

There is ONE primitive, ``call_hi_primitive``, whose param ``_prim`` is an
object of a subclass of ``VJPHiPrimitive``; its class says what it is
(``CustomVJPTraced``, ``RematTraced``, ``CheckpointName``, ``Scan3``) and its
``expand`` method gives its meaning in ordinary primitives. ``Scan3`` keeps its
carry in refs (``new_ref``, ``get``, ``swap``); :func:`lower_refs` turns it
back into a ``scan``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core
from jax.extend.core import primitives as _primitives

from revnet._engine.jaxpr.atoms import (
    Jaxpr,
    JaxprEqn,
    Literal,
    Var,
    aval_key,
    is_dropvar,
    is_literal,
)
from revnet._engine.jaxpr.bodies import Body, closed, make_body
from revnet._engine.jaxpr.scans import structure_params

HI_CALL = "call_hi_primitive"
_SCAN3 = "Scan3"

HI_CUSTOM_VJP = ("CustomVJPTraced",)
REVNET_CALL = "RevnetCall"  # revnet's own calls (:mod:`.vmappable`)


def hi_kind(eqn: JaxprEqn) -> str:
    """The class of a ``call_hi_primitive`` equation's primitive, else ``""``."""
    if eqn.primitive.name != HI_CALL:
        return ""
    return type(eqn.params["_prim"]).__name__


_HI_BODIES: dict = {}


def hi_body(prim: Any) -> Body | None:
    """A hijax primitive's meaning in ordinary primitives (its ``expand``).

    ``Scan3`` is None: its expansion is a ``while_loop`` over refs, which
    :func:`lower_refs` replaces by a ``scan`` where it can.
    """
    if type(prim).__name__ == _SCAN3 or not hasattr(prim, "expand"):
        return None
    hit = _HI_BODIES.get(id(prim))
    if hit is not None and hit[0] is prim:
        return hit[1]
    if len(_HI_BODIES) > 4096:
        _HI_BODIES.clear()
    avals = list(getattr(prim, "in_avals_flat", ()))
    if any(_is_ref_aval(a) for a in avals):
        return None

    def expanded(*leaves):
        args = jax.tree_util.tree_unflatten(prim.in_tree, leaves)
        return prim.out_tree.flatten_up_to(prim.expand(*args))

    try:
        traced = jax.make_jaxpr(expanded)(*avals)
    except Exception:  # pragma: no cover - an expansion JAX cannot trace
        return None
    body = make_body(traced)
    _HI_BODIES[id(prim)] = (prim, body)
    return body


def _is_ref_aval(a: Any) -> bool:
    return type(a).__name__ == "AbstractRef"


def _is_ref(a: Any) -> bool:
    return not is_literal(a) and _is_ref_aval(a.aval)


def scan3_refusal(eqn: JaxprEqn) -> str:
    """Why a ``Scan3`` equation left by :func:`lower_refs` is refused."""
    prim = eqn.params["_prim"]
    if getattr(prim, "reverse", False):
        return (
            "it is a lax.scan(reverse=True) under JAX_SCAN3, and jax "
            f"{jax.__version__}'s Scan3 ignores reverse (it runs forwards), so "
            "its values are not lax.scan's"
        )
    return (
        "it is a lax.scan under JAX_SCAN3 whose carry refs are used in a way "
        "revnet cannot turn back into a scan"
    )


def lower_refs(jaxpr: Jaxpr) -> Jaxpr:
    """Replaces JAX_SCAN3's scans (``Scan3`` over carry refs) by ``scan`` equations.

    ``lax.scan`` under JAX_SCAN3 makes one ref per carry leaf (``new_ref``),
    runs ``Scan3`` whose body reads the carry refs (``get``), writes them
    (``swap``) and returns the ``ys``, then reads the final carries. Where
    every ref is created in this jaxpr and only ever read or written whole,
    the refs are replaced by the values they hold and each ``Scan3`` by the
    ``scan`` with the same body, the carries as loop values. This is what
    JAX computes, except that a ``Scan3`` with ``reverse=True`` is left as
    it is (jax 0.10.2's Scan3 ignores ``reverse``, so it is not a reverse
    scan); anything else that uses refs leaves the jaxpr unchanged.
    """
    if not any(_is_ref(a) for e in jaxpr.eqns for a in (*e.invars, *e.outvars)):
        return jaxpr
    done = _discharge(jaxpr.eqns, {})
    if done is None:
        return jaxpr
    eqns, sub, _ = done
    outvars = [a if is_literal(a) else sub.get(a, a) for a in jaxpr.outvars]
    if any(_is_ref(a) for a in outvars):
        return jaxpr
    return jaxpr.replace(eqns=eqns, outvars=outvars, effects=_effects(eqns))


def _effects(eqns: Sequence[JaxprEqn]) -> Any:
    out: set = set()
    for e in eqns:
        out |= set(e.effects)
    return frozenset(out)


_EMPTY_INDEX = jax.tree_util.tree_structure(())


def _whole(e: JaxprEqn, n_in: int) -> bool:
    """Whether a ``get``/``swap`` reads or writes its ref whole (``ref[...]``)."""
    return len(e.invars) == n_in and e.params.get("tree") == _EMPTY_INDEX


def _discharge(eqns: Sequence[JaxprEqn], cur: dict):
    """``(eqns, substitutions, ref values)`` with refs replaced, or None.

    ``cur`` maps each ref variable to the value it holds (updated in place).
    """
    sub: dict = {}
    out = []

    def atom(a):
        return a if is_literal(a) else sub.get(a, a)

    for e in eqns:
        name = e.primitive.name
        ins = [atom(a) for a in e.invars]
        if name == "new_ref" and len(ins) == 1:
            cur[e.outvars[0]] = ins[0]
            continue
        if name in ("get", "swap") and _whole(e, 1 if name == "get" else 2):
            if ins[0] not in cur:
                return None
            if not is_dropvar(e.outvars[0]):
                sub[e.outvars[0]] = cur[ins[0]]
            if name == "swap":
                cur[ins[0]] = ins[1]
            continue
        if hi_kind(e) == _SCAN3:
            lowered = _scan3_as_scan(e, ins, cur)
            if lowered is not None:
                out.extend(lowered)
                continue
        if any(_is_ref(a) for a in (*ins, *e.outvars)):
            return None
        out.append(e.replace(invars=ins))
    return out, sub, cur


def _as_carry(a: Any, aval: Any) -> tuple[Any, list[JaxprEqn]]:
    """The value ``a`` with exactly the type ``aval`` (a carry's initial value)."""
    if aval_key(a.aval) == aval_key(aval):
        return a, []
    if is_literal(a):
        return Literal(np.asarray(a.val, aval.dtype), aval), []
    v = Var(aval)
    prim = _primitives.convert_element_type_p
    params = dict(new_dtype=aval.dtype, weak_type=False, sharding=None)
    return v, [jex_core.new_jaxpr_eqn([a], [v], prim, params, frozenset())]


def _scan3_as_scan(e: JaxprEqn, ins: list, cur: dict) -> list[JaxprEqn] | None:
    """A ``Scan3`` equation as a ``scan`` with its ref inputs as carries."""
    prim = e.params["_prim"]
    if getattr(prim, "reverse", False):
        return None  # jax 0.10.2 ignores it: not lax.scan's values
    body = prim.jaxpr.jaxpr
    if body.constvars or len(body.invars) != len(ins):
        return None
    ext = list(prim.extensives)
    refs = [n for n, a in enumerate(ins) if _is_ref(a)]
    if any(ext[n] or ins[n] not in cur for n in refs):
        return None
    consts = [n for n, a in enumerate(ins) if not ext[n] and n not in refs]
    xs = [n for n in range(len(ins)) if ext[n]]
    carry = [Var(body.invars[n].aval.inner_aval) for n in refs]
    inner = {body.invars[n]: c for n, c in zip(refs, carry)}
    done = _discharge(body.eqns, inner)
    if done is None:
        return None
    eqns, sub, held = done
    ys = [a if is_literal(a) else sub.get(a, a) for a in body.outvars]
    finals = [held[body.invars[n]] for n in refs]
    if any(_is_ref(a) for a in (*finals, *ys)):
        return None
    if any(aval_key(f.aval)[:2] != aval_key(c.aval)[:2] for f, c in zip(finals, carry)):
        return None
    new_body = body.replace(
        invars=[body.invars[n] for n in consts] + carry + [body.invars[n] for n in xs],
        outvars=finals + ys,
        eqns=eqns,
        effects=_effects(eqns),
    )
    pre: list[JaxprEqn] = []
    init = []
    for n, c in zip(refs, carry):
        a, extra = _as_carry(cur[ins[n]], c.aval)
        init.append(a)
        pre.extend(extra)
    final_vars = [Var(c.aval) for c in carry]
    params = dict(
        reverse=False,
        length=int(prim.length),
        jaxpr=closed(new_body, 0, ()),
        unroll=prim.unroll,
        **structure_params(len(consts), len(refs), len(xs), len(ys)),
    )
    scan = e.replace(
        primitive=_primitives.scan_p,
        params=params,
        invars=[ins[n] for n in consts] + init + [ins[n] for n in xs],
        outvars=final_vars + list(e.outvars),
        effects=new_body.effects,
    )
    for n, v in zip(refs, final_vars):
        cur[ins[n]] = v
    return [*pre, scan]
