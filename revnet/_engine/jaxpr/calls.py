"""Nested-call equations: their bodies, names and user derivative rules."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from revnet._engine.jaxpr.atoms import JaxprEqn
from revnet._engine.jaxpr.bodies import Body, as_body
from revnet._engine.jaxpr.hijax import HI_CALL, HI_CUSTOM_VJP, hi_body, hi_kind

# Names of nested-call primitives, across JAX versions, with the param that
# holds their body. ``jit`` was ``pjit`` before jax 0.7; ``custom_vjp_call`` was
# ``custom_vjp_call_jaxpr`` (body in ``fun_jaxpr``) before jax 0.6.1; ``remat``
# prints as ``remat2`` and was ``checkpoint`` in some versions.
_CALL_BODY_PARAM = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "eval_jaxpr": "call_jaxpr",  # JAX 0.12's call of a closed jaxpr
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
# Calls that mean nothing but their body (no derivative rule of their own): jit,
# and JAX 0.11's eval_jaxpr (jnp.searchsorted's inner call there).
_PLAIN_CALLS = (*JIT_NAMES, "eval_jaxpr")


def plain_call_jaxpr(eqn: JaxprEqn) -> Any:
    """The (closed) body of a call that means only its body, or None."""
    if eqn.primitive.name not in _PLAIN_CALLS:
        return None
    return eqn.params.get(_CALL_BODY_PARAM[eqn.primitive.name])


def call_body(eqn: JaxprEqn) -> Body | None:
    """The body of a nested-call equation (jit, custom_jvp/vjp, remat), or None.

    The body's input variables are its constants' variables followed by the
    equation's inputs, in order.
    """
    name = eqn.primitive.name
    if name == HI_CALL:
        return hi_body(eqn.params["_prim"])
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
    """The object tagged on a ``custom_vjp_call`` equation's backward, or None.

    Under JAX_CUSTOM_VJP3, JAX 0.11 and later hold the user's backward inside
    a closure of their own (``rule``), so its closure's functions are looked
    at too.
    """
    bwd = custom_vjp_bwd(eqn)
    found = getattr(bwd, _TAG, None)
    if found is not None or eqn.primitive.name != HI_CALL:
        return found
    for cell in getattr(bwd, "__closure__", None) or ():
        try:
            inner = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        found = getattr(getattr(inner, "f", inner), _TAG, None)
        if found is not None:
            return found
    return None


class LoopTag:
    """Tags the backward of revnet's own loops (``loop_kind``: ``"scan"`` or
    ``"while_loop"``), so that the analysis recognises their equations."""

    def __init__(self, loop_kind: str):
        self.loop_kind = loop_kind


def tag_kind(eqn: JaxprEqn) -> str | None:
    """Which of revnet's own custom VJPs an equation calls, from its tag.

    The only reader of the tags: ``"scan"`` or ``"while_loop"`` for revnet's
    loops (a :class:`LoopTag`), ``"custom_ivjp"`` for any other tagged call (a
    ``custom_ivjp`` function), None for an untagged equation.
    """
    tagged = tag_of(eqn)
    if tagged is None:
        return None
    if isinstance(tagged, LoopTag):
        return tagged.loop_kind
    return "custom_ivjp"


def custom_rule_kind(eqn: JaxprEqn) -> str | None:
    """``"vjp"``/``"jvp"`` for calls with a user derivative rule, else None."""
    name = eqn.primitive.name
    if name in _CUSTOM_VJP_NAMES or hi_kind(eqn) in HI_CUSTOM_VJP:
        return "vjp"
    if name == "custom_jvp_call":
        return "jvp"
    return None


def custom_vjp_num_consts(eqn: JaxprEqn) -> int:
    """How many of a ``custom_vjp_call``'s inputs are hoisted constants."""
    return int(eqn.params.get("num_consts", 0))


def custom_ivjp_match(eqn: JaxprEqn, trees: dict) -> tuple[int, Any] | None:
    """How a ``custom_ivjp`` function's call ``eqn`` splits, from its records.

    ``trees`` maps the flat shapes and dtypes of the function's own inputs to
    what it recorded when called with them. JAX hoists the values the function
    closes over as leading inputs of its ``custom_vjp_call`` (``num_consts``);
    once a jaxpr is traced again (under another transformation, or by revnet
    itself) they are ordinary leading inputs and ``num_consts`` is 0. The
    function's own inputs are always the last ones, so a record matches when
    the shapes of that many trailing inputs equal its key.

    Returns:
      ``(n_hoisted, record)``: how many leading inputs are hoisted values, and
      the matching record; or None when the function was not called with
      these shapes.
    """
    nc = custom_vjp_num_consts(eqn)
    for key, record in trees.items():
        nh = len(eqn.invars) - len(key)
        if nh >= nc and shapes_key([v.aval for v in eqn.invars[nh:]]) == key:
            return nh, record
    return None


def shapes_key(avals: Sequence[Any]) -> tuple:
    """The shapes and dtypes of ``avals``, as ``custom_ivjp`` functions key
    their records."""
    return tuple((tuple(a.shape), str(a.dtype)) for a in avals)


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
