"""revnet's ``scan`` under ``jax.vmap``: one scan of the batched body.

``jax.vmap`` of the loop's ``custom_vjp`` would batch its backward pass per
example, holding each example's cotangent of every weight at every step.
:func:`scan_call` binds the loop as a call that ``jax.vmap`` batches by
scanning the batched body instead (``jax.vmap`` of the body, the constants
closed over): the carry is batched along its leading axis, ``xs`` and ``ys``
along their second (the first is the steps), and the loop is made again by
the front-end with the options it had, so a per-example loop costs what the
batched loop costs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from revnet._engine import jaxpr as jx


def scan_call(
    jaxpr: Any,
    length: int,
    run: Callable[..., Any],
    consts: Sequence[Any],
    init: Sequence[Any],
    xs: Sequence[Any],
    again: Callable[[Callable[..., Any], list, list], tuple[list, list]],
) -> tuple[list[Any], list[Any]]:
    """``(final, ys)`` of the scan of ``jaxpr`` (``consts``, carry, x ->
    carry, ys); ``run(consts, init, xs)`` is the loop, returning ``ys`` and
    any more (stored decisions) after them; ``again(body, init, xs)`` makes
    the loop anew for another body, returning ``(final, ys)``."""
    nk, nc = len(consts), len(init)
    n_ys = len(jaxpr.outvars) - nc

    def flat_run(*a):
        final, ys = run(list(a[:nk]), list(a[nk : nk + nc]), list(a[nk + nc :]))
        return [*final, *list(ys)[:n_ys]]

    def rebatch(axis, values, dims):
        held, c, x = values[:nk], values[nk : nk + nc], values[nk + nc :]
        held_dims, c_dims, x_dims = dims[:nk], dims[nk : nk + nc], dims[nk + nc :]
        # The carry is batched along its leading axis (an unbatched one is
        # broadcast: the body makes it batched), xs along their second.
        c = [
            jx.vmappable.broadcast(v, axis.size) if d is None else jnp.moveaxis(v, d, 0)
            for v, d in zip(c, c_dims)
        ]
        x = [v if d is None else jnp.moveaxis(v, d, 1) for v, d in zip(x, x_dims)]
        slice_dims = [None if d is None else 0 for d in x_dims]

        def one(k, cc, xx):
            return jx.eval_body(jx.Body(jaxpr, ()), *k, *cc, *xx)

        opts = jx.vmappable.vmap_options(axis)
        in_axes = (held_dims, 0, slice_dims)
        # The carry stays batched; a y that does not depend on the example
        # stays unbatched.
        slices = [jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for v in x]
        out_axes = jx.vmappable.out_axes(one, in_axes, opts, list(held), c, slices)
        out_axes[:nc] = [0] * nc
        vmapped = jax.vmap(one, in_axes=in_axes, out_axes=out_axes, **opts)

        def body(cc, xx):
            out = vmapped(list(held), list(cc), list(xx))
            return out[:nc], out[nc:]

        final, ys = again(body, c, x)
        y_dims = [None if d is None else 1 for d in out_axes[nc:]]
        return [*final, *ys], [0] * nc + y_dims

    carry_avals = [jx.aval(v) for v in jaxpr.invars[nk : nk + nc]]
    y_avals = [jx.stacked(jx.aval(v), length) for v in jaxpr.outvars[nc:]]
    outs = jx.vmappable.call(
        flat_run, rebatch, [*consts, *init, *xs], carry_avals + y_avals
    )
    return outs[:nc], outs[nc:]
