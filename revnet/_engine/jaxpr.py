"""The one module that touches jaxpr internals.

Everything revnet needs to know about how JAX represents a traced program lives
here: how to trace a function to a closed jaxpr, which primitives are nested
calls and where they keep their body, how to bind a single equation, how to
recognise a literal or a dropped variable, and how to read an equation's source
line. JAX promises no stability for these details (``jax.extend`` is explicitly
unstable, primitive names change, ``pjit`` became ``jit``), so a JAX upgrade
should only ever need to touch this file.

The rest of revnet sees equations through a handful of small functions:

* :func:`trace` turns a function of flat arguments into ``(jaxpr, consts)``
  with the closed-over values as ordinary leading input variables;
* :func:`call_body` returns the body of a nested call equation, or ``None``;
* :func:`scan_params` describes a ``scan`` equation;
* :func:`bind` runs one equation on concrete or traced values;
* :func:`where` names the user's source line of an equation.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core
from jax.extend.core import primitives as _primitives

try:  # jax >= 0.4.36
    from jax.extend import source_info_util as _siu
except ImportError:  # pragma: no cover - older JAX
    _siu = None

Var = jex_core.Var
Literal = jex_core.Literal
Jaxpr = jex_core.Jaxpr
JaxprEqn = jex_core.JaxprEqn

# Names of nested-call primitives, across JAX versions, with the param that
# holds their body. ``jit`` was ``pjit`` before jax 0.7; ``custom_vjp_call`` was
# ``custom_vjp_call_jaxpr`` (body in ``fun_jaxpr``) before jax 0.6.1; ``remat``
# prints as ``remat2`` and was ``checkpoint`` in some versions.
_CALL_BODY_PARAM = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "remat2": "jaxpr",
    "remat": "jaxpr",
    "checkpoint": "jaxpr",
}
_CUSTOM_VJP_NAMES = ("custom_vjp_call", "custom_vjp_call_jaxpr")
JIT_NAMES = ("jit", "pjit")  # the name before jax 0.7

# JAX's "hijax" primitives (jax 0.10, behind the opt-in flags JAX_CUSTOM_VJP3,
# JAX_REMAT3 and JAX_SCAN3): ONE primitive, ``call_hi_primitive``, whose param
# ``_prim`` is an object of a subclass of ``VJPHiPrimitive``; its class says
# what it is (``CustomVJPTraced``, ``RematTraced``, ``CheckpointName``,
# ``Scan3``) and its ``expand`` method gives its meaning in ordinary primitives.
# ``Scan3`` keeps its carry in refs (``new_ref``, ``get``, ``swap``);
# :func:`lower_refs` turns it back into a ``scan``.
HI_CALL = "call_hi_primitive"
_SCAN3 = "Scan3"


@dataclasses.dataclass(frozen=True)
class Body:
    """A nested jaxpr with its constants bound to leading input variables."""

    jaxpr: Jaxpr
    consts: tuple[Any, ...]


def is_literal(v: Any) -> bool:
    return isinstance(v, Literal)


def literal_value(v: Any) -> Any:
    return v.val


def is_dropvar(v: Any) -> bool:
    return type(v).__name__ == "DropVar"


def aval(v: Any) -> Any:
    return v.aval


def aval_key(a: Any) -> Any:
    """Shape, dtype, weak type and sharding type of an abstract value, as a
    hashable key."""
    return (
        tuple(a.shape),
        str(a.dtype),
        bool(getattr(a, "weak_type", False)),
        sharding_key(a),
    )


def sharding_key(a: Any) -> Any:
    """The sharding part of an abstract value's type, as a hashable key.

    Under Explicit (or manual) axes a sharding is part of an array's type
    (``f32[16@data,8]``, ``f32[4,8]{V:data}``): two programs that differ only
    there are different programs for the analysis.
    """
    sharding = getattr(a, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    spec = getattr(sharding, "spec", None)
    mat = getattr(a, "mat", None)
    return (
        None if mesh is None or mesh.empty else repr(mesh),
        None if spec is None else repr(spec),
        None if mat is None else repr(mat_key(mat)),
    )


def mat_key(mat: Any) -> tuple:
    """The varying, unreduced and reduced mesh axes of a manual axis type."""
    return tuple(
        tuple(sorted(getattr(mat, k, ()) or ()))
        for k in ("varying", "unreduced", "reduced")
    )


def struct(a: Any) -> jax.ShapeDtypeStruct:
    """A ``jax.ShapeDtypeStruct`` of abstract value ``a``, with its sharding.

    The sharding (Explicit axes are part of the type) and the manual axis type
    (the varying axes inside ``shard_map``) are kept, so that tracing on the
    struct (``jax.eval_shape``, ``jax.make_jaxpr``) sees the same types as the
    program did.
    """
    kw: dict[str, Any] = {}
    sharding = getattr(a, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is not None and not mesh.empty:
        kw["sharding"] = sharding
    mat = getattr(a, "mat", None)
    if mat is not None and any(mat_key(mat)):
        kw["manual_axis_type"] = mat
    return jax.ShapeDtypeStruct(
        a.shape, a.dtype, weak_type=bool(getattr(a, "weak_type", False)), **kw
    )


def literal_key(lit: Any) -> Any:
    """A literal's dtype, shape and bytes, as a hashable key."""
    val = np.asarray(lit.val)
    return (str(val.dtype), val.shape, val.tobytes())


def nested_jaxpr(p: Any) -> tuple[Jaxpr, tuple] | None:
    """``(jaxpr, consts)`` when the param ``p`` is a (closed) jaxpr, else None."""
    if isinstance(p, jex_core.ClosedJaxpr) and not isinstance(p, Jaxpr):
        return p.jaxpr, tuple(p.consts)
    if isinstance(p, Jaxpr):
        return p, ()
    return None


def closed_consts(j: Any) -> tuple:
    if isinstance(j, jex_core.ClosedJaxpr) and not isinstance(j, Jaxpr):
        return tuple(j.consts) + tuple(j.jaxpr.constvars)
    return tuple(getattr(j, "constvars", ()))


_BODIES: dict = {}


def as_body(j: Any) -> Body:
    """The body of a nested jaxpr, with jits inlined; memoised per jaxpr."""
    hit = _BODIES.get(id(j))
    if hit is not None and hit[0] is j:
        return hit[1]
    if len(_BODIES) > 4096:
        _BODIES.clear()
    body = _make_body(j)
    _BODIES[id(j)] = (j, body)
    return body


def _make_body(j: Any) -> Body:
    if isinstance(j, jex_core.ClosedJaxpr) and not isinstance(j, Jaxpr):
        inner, consts = j.jaxpr, tuple(j.consts)
    else:
        inner, consts = j, ()
    if inner.constvars:
        if not consts:  # open jaxpr with constvars: not expected, refuse.
            raise NotImplementedError("open nested jaxpr with unbound constvars")
        inner = inner.replace(
            constvars=[], invars=list(inner.constvars) + list(inner.invars)
        )
    from revnet._engine.tracing import prepare  # the passes build on this module

    return Body(prepare(inner), consts)


def call_body(eqn: JaxprEqn) -> Body | None:
    """The body of a nested-call equation (jit, custom_jvp/vjp, remat), or None.

    The body's input variables are its constants' variables followed by the
    equation's inputs, in order.
    """
    name = eqn.primitive.name
    if name == HI_CALL:
        return _hi_body(eqn.params["_prim"])
    param = _CALL_BODY_PARAM.get(name)
    if param is None or param not in eqn.params:
        return None
    return as_body(eqn.params[param])


def call_name(eqn: JaxprEqn) -> str:
    """The name of the function a nested call wraps (``relu``), or ``""``."""
    if eqn.primitive.name == HI_CALL:
        prim = eqn.params["_prim"]
        fun = getattr(getattr(prim, "traced", None), "fun_name", None)
        return fun if isinstance(fun, str) else hi_kind(eqn)
    name = eqn.params.get("name")
    if isinstance(name, str):
        return name
    body = call_body(eqn)
    info = getattr(body.jaxpr, "debug_info", None) if body is not None else None
    src = getattr(info, "func_src_info", None)
    return src.split(" ")[0] if isinstance(src, str) and src else ""


def custom_vjp_bwd(eqn: JaxprEqn) -> Any:
    """The user's backward function of a ``custom_vjp_call`` equation, or None."""
    if custom_rule_kind(eqn) == "vjp" and eqn.primitive.name == HI_CALL:
        return getattr(eqn.params["_prim"], "bwd", None)
    if eqn.primitive.name not in _CUSTOM_VJP_NAMES:
        return None
    bwd = eqn.params.get("bwd")
    return getattr(bwd, "f", bwd)


_TAG = "revnet_tag"


def tag(bwd: Callable[..., Any], obj: Any) -> None:
    """Attaches ``obj`` to a ``custom_vjp`` backward function, for :func:`tag_of`.

    revnet's own custom VJPs (``custom_ivjp`` functions, the loops) tag their
    backward function so that the analysis recognises their equations.
    """
    setattr(bwd, _TAG, obj)


def tag_of(eqn: JaxprEqn) -> Any:
    """The object tagged on a ``custom_vjp_call`` equation's backward, or None."""
    return getattr(custom_vjp_bwd(eqn), _TAG, None)


def custom_rule_kind(eqn: JaxprEqn) -> str | None:
    """``"vjp"``/``"jvp"`` for calls with a user derivative rule, else None."""
    name = eqn.primitive.name
    if name in _CUSTOM_VJP_NAMES or hi_kind(eqn) in _HI_CUSTOM_VJP:
        return "vjp"
    if name == "custom_jvp_call":
        return "jvp"
    return None


def custom_vjp_num_consts(eqn: JaxprEqn) -> int:
    return int(eqn.params.get("num_consts", 0))


def custom_ivjp_key(eqn: JaxprEqn) -> tuple:
    """The shapes and dtypes of a ``custom_vjp_call``'s own (not hoisted) inputs.

    ``custom_ivjp`` functions record their pytrees under this key when called.
    """
    nh = custom_vjp_num_consts(eqn)
    return tuple((tuple(v.aval.shape), str(v.aval.dtype)) for v in eqn.invars[nh:])


@dataclasses.dataclass(frozen=True)
class ScanParams:
    body: Body
    num_consts: int
    num_carry: int
    length: int
    reverse: bool
    unroll: int | bool = 1


def scan_params(eqn: JaxprEqn) -> ScanParams | None:
    """Describes a ``scan`` equation, or returns None for anything else."""
    if eqn.primitive.name != "scan":
        return None
    p = eqn.params
    return ScanParams(
        body=as_body(p["jaxpr"]),
        num_consts=int(p["num_consts"]),
        num_carry=int(p["num_carry"]),
        length=int(p["length"]),
        reverse=bool(p["reverse"]),
        unroll=p.get("unroll", 1),
    )


def primitive_name(eqn: JaxprEqn) -> str:
    return eqn.primitive.name


def call_primitive_names() -> tuple[str, ...]:
    """Names of the nested-call primitives, across JAX versions."""
    return (*_CALL_BODY_PARAM, HI_CALL)


def key_params(eqn: JaxprEqn) -> dict[str, Any]:
    """``eqn``'s params as the plan cache compares them.

    A hijax call's one param is an object compared by identity; it is shown
    here by its class, its body and its derivative rules (``fwd``/``bwd``).
    """
    if eqn.primitive.name != HI_CALL:
        return eqn.params
    prim = eqn.params["_prim"]
    body = call_body(eqn)
    return {
        "_hi": hi_kind(eqn),
        "body": body,
        "rules": (getattr(prim, "fwd", None), getattr(prim, "bwd", None)),
    }


# --------------------------------------------------------------------------- #
# Hijax primitives (JAX_CUSTOM_VJP3, JAX_REMAT3, JAX_SCAN3).

_HI_CUSTOM_VJP = ("CustomVJPTraced",)


def hi_kind(eqn: JaxprEqn) -> str:
    """The class of a ``call_hi_primitive`` equation's primitive, else ``""``."""
    if eqn.primitive.name != HI_CALL:
        return ""
    return type(eqn.params["_prim"]).__name__


_HI_BODIES: dict = {}


def _hi_body(prim: Any) -> Body | None:
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
        closed = jax.make_jaxpr(expanded)(*avals)
    except Exception:  # pragma: no cover - an expansion JAX cannot trace
        return None
    body = _make_body(closed)
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
    closed = prim.jaxpr
    body = closed.jaxpr
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
        jaxpr=jex_core.ClosedJaxpr(new_body, ()),
        num_consts=len(consts),
        num_carry=len(refs),
        unroll=prim.unroll,
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


def scan(
    f: Callable[..., Any],
    init: Any,
    xs: Any,
    *,
    length: int | None = None,
    reverse: bool = False,
    unroll: int | bool = 1,
) -> tuple[Any, Any]:
    """``lax.scan``, as a ``scan`` primitive also under JAX_SCAN3.

    revnet's own loops run backwards with ``reverse=True``, which jax 0.10.2's
    Scan3 ignores; under that flag they bind the ``scan`` primitive directly
    (the values and derivatives of ``lax.scan`` without the flag).
    """
    if not jax.config.jax_scan3:
        return jax.lax.scan(f, init, xs, length=length, reverse=reverse, unroll=unroll)
    init_flat, init_tree = jax.tree_util.tree_flatten(init)
    xs_flat, xs_tree = jax.tree_util.tree_flatten(xs)
    if length is None:
        length = int(xs_flat[0].shape[0])
    carry_avals = [
        jax.ShapeDtypeStruct(np.shape(c), jax.numpy.result_type(c)) for c in init_flat
    ]
    init_flat = [
        jax.lax.convert_element_type(c, a.dtype) for c, a in zip(init_flat, carry_avals)
    ]
    x_avals = [
        jax.ShapeDtypeStruct(np.shape(x)[1:], jax.numpy.result_type(x)) for x in xs_flat
    ]
    y_tree: list = []
    nc = len(init_flat)

    def flat_body(*args):
        carry = jax.tree_util.tree_unflatten(init_tree, args[:nc])
        x = jax.tree_util.tree_unflatten(xs_tree, args[nc:])
        new, y = f(carry, x)
        new_flat, new_tree = jax.tree_util.tree_flatten(new)
        if new_tree != init_tree:
            raise TypeError(f"scan body carry {new_tree} differs from {init_tree}")
        new_flat = [
            jax.lax.convert_element_type(c, a.dtype)
            for c, a in zip(new_flat, carry_avals)
        ]
        y_flat, tree = jax.tree_util.tree_flatten(y)
        y_tree[:] = [tree]
        return [*new_flat, *y_flat]

    closed = jax.make_jaxpr(flat_body)(*carry_avals, *x_avals)
    inner = closed.jaxpr
    consts = list(closed.consts)
    if inner.constvars:
        inner = inner.replace(constvars=[], invars=[*inner.constvars, *inner.invars])
    if isinstance(unroll, bool):
        unroll = max(length, 1) if unroll else 1
    outs = _primitives.scan_p.bind(
        *consts,
        *init_flat,
        *xs_flat,
        reverse=bool(reverse),
        length=int(length),
        jaxpr=jex_core.ClosedJaxpr(inner, ()),
        num_consts=len(consts),
        num_carry=nc,
        unroll=int(unroll),
    )
    carry = jax.tree_util.tree_unflatten(init_tree, outs[:nc])
    return carry, jax.tree_util.tree_unflatten(y_tree[0], outs[nc:])


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


def eval_body(body: Body, *args: Any) -> list[Any]:
    """Evaluates a nested body on its (non-const) inputs."""
    return list(
        jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(body.jaxpr, ()))(*body.consts, *args)
    )


_JAX_DIR = os.path.dirname(jax.__file__)
_REVNET_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _siu is not None and hasattr(_siu, "register_exclusion"):
    # Frames inside revnet are library frames: name the user's call site instead.
    _siu.register_exclusion(_REVNET_DIR + os.sep)


def _library_dirs() -> tuple[str, ...]:
    """JAX's, revnet's and Haiku's folders: frames there are not the user's."""
    dirs = [_JAX_DIR, _REVNET_DIR]
    spec = importlib.util.find_spec("haiku")
    if spec is not None and spec.origin:
        dirs.append(os.path.dirname(spec.origin))
    return tuple(dirs)


_LIBRARY_DIRS = _library_dirs()
_ZERO_DERIVATIVE = frozenset({"stop_gradient", "floor", "ceil", "round", "sign"})


def has_zero_derivative(eqn: JaxprEqn) -> bool:
    """Whether ``eqn``'s derivative is identically zero (``stop_gradient``, ...)."""
    return primitive_name(eqn) in _ZERO_DERIVATIVE


def where(eqn: JaxprEqn) -> str:
    """The user's source line of ``eqn``, or ``""`` when it has only library frames.

    Frames inside JAX, revnet and Haiku (a module's method interception) are
    skipped, so an equation made inside a Haiku module names the user's line.
    """
    if _siu is None:  # pragma: no cover
        return ""
    try:
        summary = _siu.summarize(eqn.source_info)
    except Exception:  # pragma: no cover - defensive: never fail an error message
        return ""
    if summary and not summary.startswith(_LIBRARY_DIRS):
        return summary
    frames = getattr(getattr(eqn.source_info, "traceback", None), "frames", ())
    for f in frames:  # innermost first
        if not os.path.abspath(f.file_name).startswith(_LIBRARY_DIRS):
            return f"{f.file_name}:{f.line_num} ({f.function_name})"
    return ""


def caller_site() -> str:
    """``file:line (function)`` of the innermost frame outside revnet and JAX."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_LIBRARY_DIRS):
            return f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return ""


# --------------------------------------------------------------------------- #
# Building equations: the decision pass (:mod:`.decisions`) rewrites jaxprs
# with these, so that it never touches JAX's jaxpr classes itself.


def new_var(a: Any) -> Var:
    """A fresh variable of abstract value ``a``."""
    return Var(a)


def stacked(a: Any, length: int) -> Any:
    """The abstract value ``a`` stacked ``length`` times on a new leading axis."""
    return a.update(shape=(length, *a.shape))


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


def scan_with_body(eqn: JaxprEqn, body: Jaxpr, n_consts: int, outvars) -> JaxprEqn:
    """The ``scan`` equation ``eqn`` with a new body and outputs.

    ``body`` takes the body's ``n_consts`` constants as leading inputs (as
    :func:`as_body` gives them); their values are those of ``eqn``'s body.
    """
    consts = as_body(eqn.params["jaxpr"]).consts
    closed = jex_core.ClosedJaxpr(
        body.replace(
            constvars=list(body.invars[:n_consts]), invars=list(body.invars[n_consts:])
        ),
        list(consts),
    )
    return eqn.replace(params={**eqn.params, "jaxpr": closed}, outvars=list(outvars))


def remat_with_body(eqn: JaxprEqn, body: Jaxpr, outvars) -> JaxprEqn:
    """The ``remat`` equation ``eqn`` with a new (constant-free) body and outputs."""
    return eqn.replace(params={**eqn.params, "jaxpr": body}, outvars=list(outvars))


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
        body.jaxpr, env, lambda e: e.source_info if where(e) else source_info
    )


# --------------------------------------------------------------------------- #
# shard_map: a per-device body in its params, run in a manual-axes context.


@dataclasses.dataclass(frozen=True)
class ShardMapParams:
    """A ``shard_map`` equation: its per-device body and how it is mapped."""

    body: Body
    mesh: Any
    in_specs: tuple
    out_specs: tuple
    axis_names: frozenset
    check_vma: bool


def shard_map_params(eqn: JaxprEqn) -> ShardMapParams | None:
    """Describes a ``shard_map`` equation, or returns None for anything else."""
    if eqn.primitive.name != "shard_map":
        return None
    p = eqn.params
    return ShardMapParams(
        body=as_body(p["jaxpr"]),
        mesh=p["mesh"],
        in_specs=tuple(p["in_specs"]),
        out_specs=tuple(p["out_specs"]),
        axis_names=frozenset(
            p.get("newly_manual_axes", p.get("manual_axes", frozenset()))
        ),
        check_vma=bool(p.get("check_vma", p.get("check_rep", True))),
    )


def shard_map(
    sm: ShardMapParams, fun: Callable[..., Any], in_specs, out_specs
) -> Callable[..., Any]:
    """``fun`` mapped per device as the equation ``sm`` describes, with new specs."""
    return jax.shard_map(
        fun,
        mesh=sm.mesh,
        in_specs=tuple(in_specs),
        out_specs=tuple(out_specs),
        axis_names=set(sm.axis_names),
        check_vma=sm.check_vma,
    )


def within_shard_map(eqn: JaxprEqn, fn: Callable[[], Any]) -> Any:
    """``fn()`` run where ``eqn``'s body is traced: its manual mesh axes bound.

    The analysis of a ``shard_map`` body runs its rules on the body's types
    (``f32[4,8]{V:data}``) and collectives (``ppermute`` over ``data``), which
    only trace inside a ``shard_map``. JAX offers no public way to enter that
    context alone, so ``fn`` runs while a ``shard_map`` of the same mesh and
    specs that returns its inputs is traced abstractly.
    """
    sm = shard_map_params(eqn)
    box: list = []

    def body(*xs):
        box.append(fn())
        return xs

    jax.eval_shape(
        shard_map(sm, body, sm.in_specs, sm.in_specs),
        *[struct(v.aval) for v in eqn.invars],
    )
    return box[0]
