"""Zero, ``float0`` and accumulated cotangents: the one copy.

A custom VJP must return a cotangent for every input: zeros of the input's
dtype for a float input that got none, and ``float0`` zeros for integer (or
key) inputs. Inside loops, a carried cotangent must be an array for float
values and ``None`` for the others. These helpers implement those rules for
the interpreter and every front-end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from revnet._engine.sharded_types import cast_like, in_mesh_of


def is_float_aval(a: Any) -> bool:
    """Whether an abstract value (or array) has a floating or complex dtype."""
    return jnp.issubdtype(a.dtype, jnp.inexact)


def is_float(x: Any) -> bool:
    """Whether a value (array or Python scalar) has a floating dtype."""
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def is_float0(c: Any) -> bool:
    return getattr(c, "dtype", None) == jax.dtypes.float0


def zeros(a: Any) -> Any:
    """A zero cotangent for ``a``: ``float0`` when ``a`` is not a float; weakly
    typed when ``a`` is (as JAX's own zero cotangents); with ``a``'s sharding
    type (:mod:`.sharding`)."""
    if is_float_aval(a):
        if getattr(a, "weak_type", False):
            z = lax.full(a.shape, 0j if jnp.iscomplexobj(a) else 0.0)
            if z.dtype == a.dtype:
                return cast_like(z, a)
        return cast_like(jnp.zeros(a.shape, a.dtype), a)
    return np.zeros(a.shape, jax.dtypes.float0)


def fill(cts: Sequence[Any], avals: Sequence[Any]) -> list:
    """Cotangents as a custom VJP returns them: zeros for None, float0 for ints;
    each of its primal's type (sharding included)."""
    return [
        cast_like(c, a) if c is not None and is_float_aval(a) else zeros(a)
        for c, a in zip(cts, avals)
    ]


def float_or_none(cts: Sequence[Any], avals: Sequence[Any]) -> list:
    """Cotangents carried by a loop: zeros for None, None for non-float values."""
    out = []
    for c, a in zip(cts, avals):
        if not is_float_aval(a):
            out.append(None)
        elif c is None or is_float0(c):
            out.append(cast_like(jnp.zeros(a.shape, a.dtype), a))
        else:
            out.append(cast_like(c, a))
    return out


def drop_float0(cts: Sequence[Any]) -> list:
    """``None`` in place of ``float0`` cotangents."""
    return [None if is_float0(c) else c for c in cts]


def add(a: Any, b: Any) -> Any:
    """``a + b`` where None (and a ``float0`` cotangent) is zero."""
    if a is None or is_float0(a):
        return b
    if b is None or is_float0(b):
        return a
    with in_mesh_of(a):
        return a + cast_like(b, a)


def add_into(acc: Sequence[Any], new: Sequence[Any]) -> list:
    """Adds ``new`` to an accumulator whose None entries stay None (no gradient)."""
    return [None if a is None else add(a, b) for a, b in zip(acc, new)]


def vjp(
    fun: Callable[..., Sequence[Any]],
    args: Sequence[Any],
    out_avals: Sequence[Any],
    out_cts: Sequence[Any],
    perturbed: Sequence[bool] | None = None,
) -> list:
    """Input cotangents of ``fun(*args)`` (a list of arrays) given ``out_cts``.

    Only float inputs and outputs take part: the other inputs get None, and
    the cotangents of non-float outputs (and None ones) are ignored. With
    ``perturbed``, only those inputs are differentiated (the others have
    symbolic zero tangents) and get cotangents.
    """
    fi = [
        n
        for n, a in enumerate(args)
        if is_float(a) and (perturbed is None or perturbed[n])
    ]
    fo = [n for n, a in enumerate(out_avals) if is_float_aval(a)]
    res: list = [None] * len(args)
    if not fi or not fo:
        return res

    def f(*floats):
        full = list(args)
        for n, x in zip(fi, floats):
            full[n] = x
        outs = fun(*full)
        return [outs[n] for n in fo]

    _, pullback = jax.vjp(f, *[args[n] for n in fi])
    cts = float_or_none([out_cts[n] for n in fo], [out_avals[n] for n in fo])
    for n, c in zip(fi, pullback(cts)):
        res[n] = c
    return res


def float0_for_ints(primals: Any, cts: Any) -> Any:
    """Replaces the cotangents of non-float leaves of ``primals`` by float0 zeros."""

    def fix(p, ct):
        if is_float(p):
            return ct
        return np.zeros(np.shape(p), jax.dtypes.float0)

    return jax.tree_util.tree_map(fix, tuple(primals), tuple(cts))
