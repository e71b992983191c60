"""A call that ``jax.vmap`` batches by a rule of its own.

``jax.vmap`` of a ``jax.custom_vjp`` function batches its forward and its
backward pass element by element. For revnet's calls that is the wrong
program: the backward pass of one example holds that example's cotangent of
every weight at every step, so memory grows with the batch times the depth.
The batched call, by contrast, sums the weights' cotangents over the batch
inside each step.

:func:`call` binds ``run(*args)`` as ONE equation of JAX's hijax primitive
(``jax.experimental.hijax.HiPrim``, ``VJPHiPrimitive`` in JAX 0.10). Its
value and both derivatives are ``run``'s own (``run`` is revnet's
``custom_vjp`` function, whose backward pass runs under ``jax.vjp``); only
batching is its own:
``rebatch(axis, args, dims)`` builds the call again on the batched program,
so that a ``jax.vmap`` over examples runs one reversible call on the batch,
as the batched call would. Nested ``vmap``s batch level by level.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import hijax

# JAX 0.10 names the base class of a user-defined hijax primitive
# VJPHiPrimitive; JAX 0.11 renamed it HiPrim, with the same interface.
_HiPrim = getattr(hijax, "HiPrim", None) or hijax.VJPHiPrimitive
Zero = hijax.Zero


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, eq=False)
class _Static:
    """A parameter compared by identity (a function, flags)."""

    value: Any


def _instantiate(t: Any) -> Any:
    """A symbolic zero as an array (float0 for integer inputs)."""
    if not isinstance(t, Zero):
        return t
    a = t.aval
    if a.dtype == jax.dtypes.float0:
        return np.zeros(a.shape, a.dtype)
    return t.instantiate()  # of the aval's type: its sharding, varying axes


class RevnetCall(_HiPrim):
    """``run(*args)``: its value and derivatives, batched by ``rebatch``."""

    def __init__(self, run, rebatch, in_avals, out_avals):
        self.in_avals = tuple(in_avals)
        self.out_aval = tuple(out_avals)
        self.params = dict(run=_Static(run), rebatch=_Static(rebatch))
        super().__init__()

    def expand(self, *args):
        return tuple(self.run.value(*args))

    def vjp_fwd(self, nzs_in, *args):
        # Only the perturbed inputs are differentiated: run's custom VJP sees
        # the others as constants, as it does under jax.grad.
        nz = tuple(bool(z) for z in jax.tree_util.tree_leaves(nzs_in))
        run = self.run.value

        def part(*live):
            it = iter(live)
            return tuple(run(*[next(it) if z else a for a, z in zip(args, nz)]))

        outs, pull = jax.vjp(part, *[a for a, z in zip(args, nz) if z])
        return outs, (pull, _Static(nz))

    def vjp_bwd(self, res, cts, *accums):
        pull, nz = res
        grads = iter(pull(tuple(_instantiate(c) for c in cts)))
        for acc, z in zip(accums, nz.value):
            if z:
                acc.accum(next(grads))

    def jvp(self, primals, tangents):
        # jax.checkpoint and jvp-of-grad linearize through here: run's own
        # custom VJP (forward mode proper is refused by it, naming revnet).
        run = self.run.value
        outs, touts = jax.jvp(
            lambda *a: tuple(run(*a)), primals, tuple(map(_instantiate, tangents))
        )
        return outs, touts

    def lin(self, nzs_in, *primals):
        # jax.linearize is forward mode: refused now, as run's custom VJP
        # refuses jax.jvp (the front end names the call), not when the linear
        # function is first evaluated.
        raise TypeError("can't apply forward-mode autodiff (linearize) to revnet")

    def linearized(self, residuals, *tangents):
        raise TypeError("can't apply forward-mode autodiff (linearize) to revnet")

    def batch(self, axis_data, args, dims):
        outs, out_dims = self.rebatch.value(axis_data, list(args), list(dims))
        return tuple(outs), tuple(out_dims)


def call(
    run: Callable[..., Sequence[Any]],
    rebatch: Callable[[Any, list, list], tuple[Sequence[Any], Sequence[Any]]],
    args: Sequence[Any],
    out_avals: Sequence[Any],
) -> list[Any]:
    """``run(*args)`` (flat lists of arrays) as one call that ``rebatch`` batches.

    ``rebatch(axis, args, dims)`` gets the batched axis (its ``size``, and
    :func:`vmap_options`), the arguments and their batch dimensions (None for
    an unbatched one), and returns the outputs and theirs.
    """
    args = [jnp.asarray(a) if not hasattr(a, "dtype") else a for a in args]
    prim = RevnetCall(run, rebatch, [jax.typeof(a) for a in args], out_avals)
    return list(prim(*args))


def vmap_options(axis: Any) -> dict[str, Any]:
    """``jax.vmap``'s keywords that batch along ``axis`` as the caller's vmap
    does: its size, its name (for collectives) and its SPMD mesh axes."""
    name = axis.name
    opts: dict[str, Any] = dict(axis_size=axis.size)
    if type(name) is not object:  # JAX's sentinel for an unnamed axis
        opts["axis_name"] = name
    if axis.spmd_name is not None:
        opts["spmd_axis_name"] = axis.spmd_name
    return opts


def out_axes(
    fun: Callable[..., Sequence[Any]],
    in_axes: Any,
    options: dict[str, Any],
    *args: Any,
) -> list[int | None]:
    """0 for each output of ``jax.vmap(fun, in_axes)(*args)`` that is batched,
    None for one that is not (a statistic reduced over the vmapped axis).

    Found by tracing once, abstractly: each output passes through an identity
    whose batching rule (``jax.custom_batching.custom_vmap``) notes whether
    it is batched; one that is not batched never reaches its rule.
    """
    batched: set[int] = set()

    def probe(n: int, x: Any) -> Any:
        @jax.custom_batching.custom_vmap
        def identity(x):
            return x

        @identity.def_vmap
        def _rule(axis_size, in_batched, x):
            if in_batched[0]:
                batched.add(n)
            return x, in_batched[0]

        return identity(x)

    def probed(*a):
        return [probe(n, o) for n, o in enumerate(fun(*a))]

    outs = jax.eval_shape(jax.vmap(probed, in_axes=in_axes, **options), *args)
    return [0 if n in batched else None for n in range(len(outs))]


def broadcast(x: Any, size: int) -> Any:
    """``x`` repeated ``size`` times along a new leading axis."""
    return jnp.broadcast_to(x, (size, *jnp.shape(x)))
