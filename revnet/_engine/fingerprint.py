"""Cache keys for traced programs: by structure, or by structure and values.

Two keys are computed from a jaxpr, for two kinds of cache:

* :func:`structure` is equal for two jaxprs with the same equations, wiring,
  shapes, dtypes, literal values and params. Objects a param holds (a
  ``custom_jvp``'s rule, a ``custom_vjp``'s backward, the constants of a nested
  jaxpr) are compared by kind and shape only. A plan depends on nothing else,
  so plans are cached by this key: a program retraced with new rule objects
  (every trace of ``jax.nn.relu`` makes new ones) or new nested weights reuses
  its plan, and the interpreter takes those objects from the current jaxpr.
* :func:`primal` compares nested constants and other objects (a callback's
  function) by identity, and ``custom_ivjp`` functions too (their inverse is
  what an enclosing inversion runs), but not other derivative rules: a
  function computing only values (a jitted forward loop) may be reused for a
  jaxpr with an equal primal key.
"""

from __future__ import annotations

from typing import Any

from revnet._engine import jaxpr as jx


class _Opaque:
    """A token standing for an object compared by identity (kept alive)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Opaque) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def structure(jaxpr: jx.Jaxpr) -> Any:
    """A hashable key equal for two jaxprs that have one plan (see module doc)."""
    return _key(jaxpr, False)


def primal(jaxpr: jx.Jaxpr) -> Any:
    """A key equal for two jaxprs that compute the same values.

    Nested constants and other objects are compared by identity (the key
    holds references to them, so that an identity cannot be reused while the
    key is alive); derivative rules (a ``custom_jvp``'s rule, a
    ``custom_vjp``'s forward and backward) are not compared: they do not
    change a value, only a derivative.
    """
    return _key(jaxpr, True)


def _tag_token(tag: Any, eqn: jx.JaxprEqn) -> Any:
    """What of a revnet-tagged equation (loops, custom_ivjp) a plan depends on."""
    kind = jx.tag_kind(eqn)
    if kind != "custom_ivjp":
        return ("loop", kind)
    return ("custom_ivjp", tag.num_consts, jx.custom_ivjp_match(eqn, tag.trees))


def _key(jaxpr: jx.Jaxpr, consts_by_id: bool) -> Any:
    names: dict = {}

    def var(a):
        if jx.is_literal(a):
            return ("lit", jx.literal_key(a))
        if jx.is_dropvar(a):
            return ("drop", jx.aval_key(a.aval))
        if a not in names:
            names[a] = len(names)
        return names[a]

    def const(c):
        if consts_by_id:
            return _Opaque(c)
        return ("const", tuple(getattr(c, "shape", ())), str(getattr(c, "dtype", "")))

    def value(p, rules=False):
        if isinstance(p, jx.Body):  # a hijax call's body (jx.key_params)
            inner = _key(p.jaxpr, consts_by_id)
            return ("body", inner, tuple(map(const, p.consts)))
        nested = jx.nested_jaxpr(p)
        if nested is not None:
            inner, consts = nested
            return (
                "jaxpr",
                _key(inner, consts_by_id),
                tuple(map(const, consts)),
            )
        if isinstance(p, (tuple, list)):
            return (type(p).__name__, tuple(value(q, rules) for q in p))
        if isinstance(p, dict):
            return ("dict", tuple((k, value(q, rules)) for k, q in sorted(p.items())))
        if isinstance(p, (str, int, float, bool, complex, type(None))):
            return p
        # A callback's function changes what is computed; a custom derivative
        # rule changes only derivatives.
        by_id = consts_by_id and not rules
        try:
            hash(p)
        except TypeError:
            return _Opaque(p) if by_id else "opaque"
        if callable(p) or hasattr(p, "f"):
            return _Opaque(p) if by_id else "opaque"
        return p

    def eqn_key(e):
        rules = jx.custom_rule_kind(e) is not None or jx.primitive_name(e).startswith(
            "custom_"
        )
        params = tuple(
            (k, value(q, rules)) for k, q in sorted(jx.key_params(e).items())
        )
        tag = jx.tag_of(e)
        if tag is not None:
            params += (("revnet_tag", _tag_token(tag, e)),)
            if consts_by_id and jx.tag_kind(e) == "custom_ivjp":
                # A custom_ivjp's inverse is what an enclosing inversion
                # runs: a function reused for this jaxpr must carry it.
                params += (("revnet_inverse", _Opaque(tag)),)
        return (
            jx.primitive_name(e),
            tuple(var(a) for a in e.invars),
            tuple(var(a) for a in e.outvars),
            params,
        )

    head = tuple((var(v), jx.aval_key(v.aval)) for v in jaxpr.invars)
    eqns = tuple(eqn_key(e) for e in jaxpr.eqns)
    return (
        head,
        eqns,
        tuple(var(v) for v in jaxpr.outvars),
        tuple(jx.aval_key(v.aval) for v in jaxpr.outvars),
    )
