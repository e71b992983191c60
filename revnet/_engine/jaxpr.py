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
    param = _CALL_BODY_PARAM.get(name)
    if param is None or param not in eqn.params:
        return None
    return as_body(eqn.params[param])


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
    if name in _CUSTOM_VJP_NAMES:
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
    return tuple(_CALL_BODY_PARAM)


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
