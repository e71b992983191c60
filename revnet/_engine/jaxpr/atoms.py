"""Variables, literals and abstract values of a jaxpr, and keys on them."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core

Var = jex_core.Var
Literal = jex_core.Literal
Jaxpr = jex_core.Jaxpr
JaxprEqn = jex_core.JaxprEqn


def is_literal(v: Any) -> bool:
    """Whether the atom ``v`` is a literal (a constant written in the equation)."""
    return isinstance(v, Literal)


def literal_value(v: Any) -> Any:
    """The value of the literal ``v``."""
    return v.val


def is_dropvar(v: Any) -> bool:
    """Whether ``v`` is a dropped output (``_``), which no equation reads."""
    return type(v).__name__ == "DropVar"


def is_ref(v: Any) -> bool:
    """Whether ``v`` (a variable or literal) is a mutable array reference."""
    return isinstance(aval(v), jax.ref.AbstractRef)


def aval(v: Any) -> Any:
    """The abstract value (shape, dtype, sharding) of the atom ``v``."""
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


def primitive_name(eqn: JaxprEqn) -> str:
    """The name of ``eqn``'s primitive."""
    return eqn.primitive.name


_ZERO_DERIVATIVE = frozenset({"stop_gradient", "floor", "ceil", "round", "sign"})


def has_zero_derivative(eqn: JaxprEqn) -> bool:
    """Whether ``eqn``'s derivative is identically zero (``stop_gradient``, ...)."""
    return primitive_name(eqn) in _ZERO_DERIVATIVE


def new_var(a: Any) -> Var:
    """A fresh variable of abstract value ``a``."""
    return Var(a)


def scalar_aval(dtype: Any) -> Any:
    """The abstract value of a scalar of ``dtype``, on no mesh."""
    return jax.core.ShapedArray((), np.dtype(dtype))


def stacked(a: Any, length: int) -> Any:
    """The abstract value ``a`` stacked ``length`` times on a new leading axis,
    which no mesh axis splits (a sharded value's spec gains a leading None,
    as ``lax.scan`` stacks its ``ys``)."""
    sharding = getattr(a, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None:
        return a.update(shape=(length, *a.shape))
    spec = spec.update(partitions=(None, *spec))
    return a.update(shape=(length, *a.shape), sharding=sharding.update(spec=spec))


def row(a: Any) -> Any:
    """The abstract value of one row of ``a`` (its leading axis taken away), as
    ``lax.scan`` gives each ``x`` to its body: a sharded value keeps the
    sharding of its other axes (``f32[5,16@data]`` gives ``f32[16@data]``)."""
    sharding = getattr(a, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None:
        return a.update(shape=tuple(a.shape[1:]))
    spec = spec.update(partitions=tuple(spec)[1:])
    return a.update(shape=tuple(a.shape[1:]), sharding=sharding.update(spec=spec))
