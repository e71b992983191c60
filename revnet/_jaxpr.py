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
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core

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


def trace(fun: Callable[..., Any], args: Sequence[Any]) -> tuple[Jaxpr, list, Any]:
    """Traces ``fun(*args)`` (flat arrays) to an open jaxpr plus its consts.

    Returns:
      ``(jaxpr, consts, out_tree)``; ``jaxpr.invars`` are the consts' variables
      followed by the arguments' variables, and ``jaxpr.constvars`` is empty.
      ``consts`` holds every closed-over value, possibly tracers of an outer
      transformation or integer arrays (keys, counters).
    """
    closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*args)
    out_tree = jax.tree_util.tree_structure(out_shape)
    jaxpr = closed.jaxpr
    consts = list(closed.consts)
    open_jaxpr = jaxpr.replace(
        constvars=[], invars=list(jaxpr.constvars) + list(jaxpr.invars)
    )
    return _prepare(open_jaxpr), consts, out_tree


def _prepare(jaxpr: Jaxpr) -> Jaxpr:
    """Inlines jits, names dropped scan outputs and merges duplicate equations."""
    return cse(_name_scan_outputs(inline_jits(jaxpr)))


_JIT_NAMES = ("jit", "pjit")


def inline_jits(jaxpr: Jaxpr) -> Jaxpr:
    """Replaces nested ``jit`` equations (without constants) by their bodies.

    ``jnp`` functions are jits (``jnp.where`` is a jit around ``select_n``), and
    inverting them may need equations on both sides of the boundary. Inlining
    does not change what is computed.
    """

    def inlinable(e):
        return e.primitive.name in _JIT_NAMES and not _closed_consts(e.params["jaxpr"])

    if not any(inlinable(e) for e in jaxpr.eqns):
        return jaxpr
    sub: dict = {}

    def outer(a):
        return a if isinstance(a, Literal) else sub.get(a, a)

    eqns = []
    for e in jaxpr.eqns:
        if not inlinable(e):
            eqns.append(e.replace(invars=[outer(a) for a in e.invars]))
            continue
        inner = inline_jits(_as_body(e.params["jaxpr"]).jaxpr)
        env = {bv: outer(ov) for bv, ov in zip(inner.invars, e.invars)}

        def rename(a, env=env):
            if isinstance(a, Literal) or is_dropvar(a):
                return a
            if a not in env:
                env[a] = Var(a.aval)
            return env[a]

        for ie in inner.eqns:
            # Equations of library code (``jnp.sort``) carry only library frames:
            # they are attributed to the user's call of the inlined function.
            info = ie.source_info if where(ie) else e.source_info
            eqns.append(
                ie.replace(
                    invars=[rename(a) for a in ie.invars],
                    outvars=[rename(a) for a in ie.outvars],
                    source_info=info,
                )
            )
        for ov, bo in zip(e.outvars, inner.outvars):
            if not is_dropvar(ov):
                sub[ov] = rename(bo)
    return jaxpr.replace(eqns=eqns, outvars=[outer(a) for a in jaxpr.outvars])


def _name_scan_outputs(jaxpr: Jaxpr) -> Jaxpr:
    """Gives dropped outputs of ``scan`` equations a variable.

    ``fori_loop`` drops its final counter; naming it lets the analysis compute
    it forward and then run the loop backwards from it.
    """
    if not any(
        e.primitive.name == "scan" and any(is_dropvar(v) for v in e.outvars)
        for e in jaxpr.eqns
    ):
        return jaxpr
    eqns = []
    for e in jaxpr.eqns:
        if e.primitive.name == "scan":
            outs = [Var(v.aval) if is_dropvar(v) else v for v in e.outvars]
            e = e.replace(outvars=outs)
        eqns.append(e)
    return jaxpr.replace(eqns=eqns)


def cse(jaxpr: Jaxpr) -> Jaxpr:
    """Merges equations that compute the same thing from the same inputs.

    ``x[:, 2:]`` written twice is two ``slice`` equations; once merged, knowing
    one output means knowing the other. Equations with effects, and those
    whose params cannot be compared, are kept as they are.
    """
    seen: dict = {}
    sub: dict = {}
    eqns = []

    def outer(a):
        return a if isinstance(a, Literal) else sub.get(a, a)

    for e in jaxpr.eqns:
        e = e.replace(invars=[outer(a) for a in e.invars])
        key = _eqn_key(e)
        hit = seen.get(key) if key is not None else None
        if hit is not None:
            for ov, hv in zip(e.outvars, hit.outvars):
                if not is_dropvar(ov):
                    sub[ov] = hv
            continue
        if key is not None and not any(is_dropvar(v) for v in e.outvars):
            seen[key] = e
        eqns.append(e)
    if not sub:
        return jaxpr
    return jaxpr.replace(eqns=eqns, outvars=[outer(a) for a in jaxpr.outvars])


def _eqn_key(e: JaxprEqn) -> Any:
    if e.effects:
        return None
    try:
        params = tuple(sorted(e.params.items()))
        ins = tuple(
            ("lit", _literal_key(a)) if isinstance(a, Literal) else a for a in e.invars
        )
        key = (e.primitive.name, ins, params)
        hash(key)
    except TypeError:
        return None
    return key


def _literal_key(lit: Any) -> Any:
    val = np.asarray(lit.val)
    return (str(val.dtype), val.shape, val.tobytes())


def restrict(jaxpr: Jaxpr, out_idx: Sequence[int]) -> tuple[Jaxpr, list[int]]:
    """The part of ``jaxpr`` that computes the outputs ``out_idx``.

    Returns:
      ``(sub, in_idx)``: ``sub`` has the inputs ``in_idx`` of ``jaxpr`` (the
      ones those outputs depend on, in order) and the outputs ``out_idx``.
    """
    outs = [jaxpr.outvars[i] for i in out_idx]
    need = {v for v in outs if not isinstance(v, Literal)}
    kept = []
    for e in reversed(jaxpr.eqns):
        if any(v in need for v in e.outvars if not is_dropvar(v)):
            kept.append(e)
            need.update(a for a in e.invars if not isinstance(a, Literal))
    in_idx = [n for n, v in enumerate(jaxpr.invars) if v in need]
    sub = jaxpr.replace(
        invars=[jaxpr.invars[n] for n in in_idx],
        outvars=outs,
        eqns=list(reversed(kept)),
        effects=jaxpr.effects,
    )
    return sub, in_idx


# --------------------------------------------------------------------------- #
# Fingerprints: cache keys that cover everything that determines a program.


class _Opaque:
    """A token standing for an object compared by identity (kept alive)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Opaque) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def fingerprint(jaxpr: Jaxpr) -> Any:
    """A hashable key equal for two jaxprs only if they compute the same thing.

    Structure, shapes, dtypes, literal values and params are compared by value;
    nested jaxprs recursively, with their constants by identity; anything else
    in a param (a ``custom_vjp``'s backward function, a ``custom_jvp`` rule) by
    identity. The key holds references to those objects, so that an identity
    cannot be reused while the key is alive.
    """
    names: dict = {}

    def var(a):
        if isinstance(a, Literal):
            return ("lit", _literal_key(a))
        if is_dropvar(a):
            return ("drop", _aval_key(a.aval))
        if a not in names:
            names[a] = len(names)
        return names[a]

    def value(p):
        if isinstance(p, (Jaxpr, jex_core.ClosedJaxpr)):
            inner, consts = (
                (p.jaxpr, tuple(p.consts))
                if isinstance(p, jex_core.ClosedJaxpr) and not isinstance(p, Jaxpr)
                else (p, ())
            )
            return ("jaxpr", fingerprint(inner), tuple(_Opaque(c) for c in consts))
        if isinstance(p, (tuple, list)):
            return (type(p).__name__, tuple(value(q) for q in p))
        if isinstance(p, dict):
            return ("dict", tuple((k, value(q)) for k, q in sorted(p.items())))
        if isinstance(p, (str, int, float, bool, complex, type(None), np.dtype)):
            return p
        try:
            hash(p)
        except TypeError:
            return _Opaque(p)
        if callable(p) or hasattr(p, "f"):
            return _Opaque(p)
        return p

    eqns = tuple(
        (
            e.primitive.name,
            tuple(var(a) for a in e.invars),
            tuple(var(a) for a in e.outvars),
            tuple((k, value(q)) for k, q in sorted(e.params.items())),
        )
        for e in jaxpr.eqns
    )
    head = tuple((var(v), _aval_key(v.aval)) for v in jaxpr.invars)
    return (
        head,
        eqns,
        tuple(var(v) for v in jaxpr.outvars),
        tuple(_aval_key(v.aval) for v in jaxpr.outvars),
    )


def _aval_key(a: Any) -> Any:
    return (tuple(a.shape), str(a.dtype), bool(getattr(a, "weak_type", False)))


def _closed_consts(j: Any) -> tuple:
    if isinstance(j, jex_core.ClosedJaxpr) and not isinstance(j, Jaxpr):
        return tuple(j.consts) + tuple(j.jaxpr.constvars)
    return tuple(getattr(j, "constvars", ()))


_BODIES: dict = {}


def _as_body(j: Any) -> Body:
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
    return Body(_prepare(inner), consts)


def call_body(eqn: JaxprEqn) -> Body | None:
    """The body of a nested-call equation (jit, custom_jvp/vjp, remat), or None.

    The body's input variables are its constants' variables followed by the
    equation's inputs, in order.
    """
    name = eqn.primitive.name
    param = _CALL_BODY_PARAM.get(name)
    if param is None or param not in eqn.params:
        return None
    return _as_body(eqn.params[param])


def call_name(eqn: JaxprEqn) -> str:
    """The name of the function a nested call wraps (``relu``), or ``""``."""
    name = eqn.params.get("name")
    if isinstance(name, str):
        return name
    body = call_body(eqn)
    info = getattr(body.jaxpr, "debug_info", None) if body is not None else None
    src = getattr(info, "func_src_info", None)
    return src.split(" ")[0] if isinstance(src, str) and src else ""


def custom_vjp_bwd(eqn: JaxprEqn) -> Any:
    """The user's backward function of a ``custom_vjp_call`` equation, or None."""
    if eqn.primitive.name not in _CUSTOM_VJP_NAMES:
        return None
    bwd = eqn.params.get("bwd")
    return getattr(bwd, "f", bwd)


def custom_rule_kind(eqn: JaxprEqn) -> str | None:
    """``"vjp"``/``"jvp"`` for calls with a user derivative rule, else None.

    revnet's own loops are ``custom_vjp`` functions whose rule is exactly the
    VJP of their body; they return ``"loop:scan"`` or ``"loop:while_loop"``.
    """
    name = eqn.primitive.name
    if name in _CUSTOM_VJP_NAMES:
        loop = getattr(custom_vjp_bwd(eqn), "_revnet_loop", None)
        return f"loop:{loop}" if loop else "vjp"
    if name == "custom_jvp_call":
        return "jvp"
    return None


def custom_vjp_num_consts(eqn: JaxprEqn) -> int:
    return int(eqn.params.get("num_consts", 0))


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
        body=_as_body(p["jaxpr"]),
        num_consts=int(p["num_consts"]),
        num_carry=int(p["num_carry"]),
        length=int(p["length"]),
        reverse=bool(p["reverse"]),
        unroll=p.get("unroll", 1),
    )


def primitive_name(eqn: JaxprEqn) -> str:
    return eqn.primitive.name


def bind(eqn: JaxprEqn, *args: Any) -> list[Any]:
    """Runs one equation on ``args``; always returns a list of outputs."""
    prim = eqn.primitive
    params = prim.get_bind_params(eqn.params)
    if isinstance(params, tuple):  # jax < 0.10: (subfuns, params)
        subfuns, params = params
    else:
        subfuns = ()
    with eqn.ctx.manager:
        out = prim.bind(*subfuns, *args, **params)
    return list(out) if prim.multiple_results else [out]


def eval_body(body: Body, *args: Any) -> list[Any]:
    """Evaluates a nested body on its (non-const) inputs."""
    return list(
        jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(body.jaxpr, ()))(*body.consts, *args)
    )


_JAX_DIR = os.path.dirname(jax.__file__)
_REVNET_DIR = os.path.dirname(os.path.abspath(__file__))
if _siu is not None and hasattr(_siu, "register_exclusion"):
    # Frames inside revnet are library frames: name the user's call site instead.
    _siu.register_exclusion(_REVNET_DIR + os.sep)


def where(eqn: JaxprEqn) -> str:
    """The user's source line of ``eqn``, or ``""`` when it has only library frames."""
    if _siu is None:  # pragma: no cover
        return ""
    try:
        summary = _siu.summarize(eqn.source_info)
    except Exception:  # pragma: no cover - defensive: never fail an error message
        return ""
    if not summary or summary.startswith((_JAX_DIR, _REVNET_DIR)):
        return ""
    return summary


def caller_site() -> str:
    """``file:line (function)`` of the innermost frame outside revnet and JAX."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith((_JAX_DIR, _REVNET_DIR)):
            return f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return ""
