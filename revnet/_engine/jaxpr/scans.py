"""``scan`` equations: described, rebuilt with a new body, and bound."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core
from jax.extend.core import primitives as _primitives

from revnet._engine.jaxpr.atoms import Jaxpr, JaxprEqn
from revnet._engine.jaxpr.bodies import Body, as_body


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


def scan_with_body(
    eqn: JaxprEqn, body: Jaxpr, n_consts: int, outvars, more_xs=()
) -> JaxprEqn:
    """The ``scan`` equation ``eqn`` with a new body and outputs.

    ``body`` takes the body's ``n_consts`` constants as leading inputs (as
    :func:`as_body` gives them); their values are those of ``eqn``'s body.
    ``more_xs`` are further scanned inputs, read by ``body``'s last inputs.
    """
    consts = as_body(eqn.params["jaxpr"]).consts
    closed = jex_core.ClosedJaxpr(
        body.replace(
            constvars=list(body.invars[:n_consts]), invars=list(body.invars[n_consts:])
        ),
        list(consts),
    )
    params = {**eqn.params, "jaxpr": closed}
    if more_xs and "linear" in params:
        params["linear"] = (*params["linear"], *[False] * len(more_xs))
    return eqn.replace(
        params=params, invars=[*eqn.invars, *more_xs], outvars=list(outvars)
    )


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
