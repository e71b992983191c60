"""``scan`` equations: described, rebuilt with a new body, and bound.

How a ``scan`` equation says which of its inputs are constants, carries and
scanned inputs differs between JAX releases: counts ``num_consts`` and
``num_carry`` (JAX 0.10), or flat-tree descriptors ``ft_in`` and ``ft_out``
(JAX 0.11 on). :func:`scan_params` reads either; :func:`structure_params`
writes them, and is the one place in revnet that imports a private JAX
module (the flat trees have no public constructor).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.extend.core import primitives as _primitives

from revnet._engine.jaxpr.atoms import Jaxpr, JaxprEqn
from revnet._engine.jaxpr.bodies import Body, as_body, closed

# Whether scan equations describe their inputs by flat trees (JAX >= 0.11).
FLAT_TREES = jax.__version_info__ >= (0, 11)


def structure_params(n_consts: int, n_carry: int, n_xs: int, n_ys: int) -> dict:
    """The params of a ``scan`` equation that say how its inputs and outputs
    split: ``n_consts`` constants, ``n_carry`` carries and ``n_xs`` scanned
    inputs in; the carries and ``n_ys`` stacked outputs out.

    Raises:
      ImportError: naming the JAX version, if JAX moved its flat trees.
    """
    if not FLAT_TREES:
        return dict(num_consts=n_consts, num_carry=n_carry)
    try:
        from jax._src import flattree as ft  # the one private JAX import

        ft_in = ft.pack((ft.nones(n_consts), ft.nones(n_carry), ft.nones(n_xs)))
        ft_out = ft.pack((ft.nones(n_carry), ft.nones(n_ys)))
    except (ImportError, AttributeError) as err:
        raise ImportError(
            f"revnet cannot build a scan under jax {jax.__version__}: "
            f"jax._src.flattree.pack/nones moved ({err})"
        ) from err
    return dict(ft_in=ft_in, ft_out=ft_out)


def _counts(params: dict) -> tuple[int, int]:
    """``(number of constants, number of carries)`` of a scan's params."""
    if "ft_in" in params:
        consts, carry, _ = params["ft_in"].unpack()
        return len(consts), len(carry)
    return int(params["num_consts"]), int(params["num_carry"])


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
    num_consts, num_carry = _counts(p)
    return ScanParams(
        body=as_body(p["jaxpr"]),
        num_consts=num_consts,
        num_carry=num_carry,
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
    params = {**eqn.params, "jaxpr": closed(body, n_consts, consts)}
    nk, nc = _counts(eqn.params)
    n_xs = len(eqn.invars) - nk - nc + len(more_xs)
    params.update(structure_params(nk, nc, n_xs, len(outvars) - nc))
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

    traced = jax.make_jaxpr(flat_body)(*carry_avals, *x_avals)
    inner = traced.jaxpr
    consts = list(traced.consts)
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
        jaxpr=closed(inner, 0, ()),
        unroll=int(unroll),
        **structure_params(len(consts), nc, len(xs_flat), len(inner.outvars) - nc),
    )
    carry = jax.tree_util.tree_unflatten(init_tree, outs[:nc])
    return carry, jax.tree_util.tree_unflatten(y_tree[0], outs[nc:])
