"""How a stored decision is made, and how its equation's results are made
from it: one ``(decide, values, own)`` form per kind of decision.

``decide(*ins)`` computes what the forward pass stores; ``values(*ins,
stored)`` computes the equation's results from it, and is what the backward
pass evaluates on rebuilt inputs. ``own`` is the position of the equation's
output that is the stored value itself (``top_k``'s indices), or None.

* ``top_k``/``approx_top_k``: the indices are stored, the values gathered.
* ``sort``: the permutation is stored, every operand gathered with it.
* ``sign``: stored as int8.
* kinks ``max``/``min``/``abs``/``relu`` with ``kinks="store"``: the branch
  (int8 or bool), differentiated as ``jax.grad`` does at a tie.
* anything else (:func:`at_point`): the equation's rebuilt float inputs are
  stored, and the backward pass evaluates the equation, and its derivative,
  at those stored values: exactly the forward pass's results and
  ``jax.grad``'s derivative, with the cotangent sent to the rebuilt inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from revnet._engine import cotangents
from revnet._engine import jaxpr as jx
from revnet._engine.interpreter import apply_eqn, vjp_eqn

Form = tuple[Callable[..., list], Callable[..., list], int | None]


def top_k(e) -> Form:
    """The indices of ``top_k``/``approx_top_k``, as the primitive picks them
    (ties included), and its values gathered with them."""
    if jx.primitive_name(e) == "approx_top_k":
        axis = e.params["reduction_dimension"]
    else:
        axis = e.params.get("axis", -1)

    def decide(*ins):
        return [apply_eqn(e, ins)[1]]

    def values(*args):
        *ins, idx = args
        return [jnp.take_along_axis(ins[0], idx, axis=axis)]

    return decide, values, 1


def sort(e) -> Form:
    dim, nk = e.params["dimension"], e.params["num_keys"]
    stable = e.params["is_stable"]

    def decide(*ops):
        iota = lax.broadcasted_iota(jnp.int32, ops[0].shape, dim)
        keys = (*ops[:nk], iota)
        return [lax.sort(keys, dimension=dim, is_stable=stable, num_keys=nk)[-1]]

    def values(*args):
        *xs, perm = args
        return [jnp.take_along_axis(x, perm, axis=dim) for x in xs]

    return decide, values, None


def sign(e) -> Form:
    """``sign`` stored as int8, converted back to its float dtype."""
    dtype = jx.aval(e.outvars[0]).dtype
    return (
        lambda x: [jnp.sign(x).astype(jnp.int8)],
        lambda x, d: [d.astype(dtype)],
        None,
    )


def kink(e, name: str) -> Form:
    """The branch of ``max``, ``min``, ``abs`` or ``relu``."""
    if name == "relu":
        return (
            lambda x: [x > 0],
            lambda x, d: [jnp.where(d, x, jnp.zeros_like(x))],
            None,
        )
    if name == "abs":
        return lambda x: [x >= 0], lambda x, d: [jnp.where(d, x, -x)], None
    first = name == "max"

    def decide(a, b):
        a, b = jnp.broadcast_arrays(a, b)
        return [(a > b).astype(jnp.int8) - (a < b).astype(jnp.int8) + 1]

    def values(a, b, d):
        # max: a where a > b, b where a < b, half of each at a tie (as jax.grad
        # differentiates max); min the other way round.
        a, b = jnp.broadcast_arrays(a, b)
        hi, lo = (a, b) if first else (b, a)
        half = a * 0.5 + b * 0.5
        return [lax.select_n(d.astype(jnp.int32), lo, half, hi)]

    return decide, values, None


def _copy(x):
    """``x``, by an equation without an inverse rule: the analysis must not
    rebuild an input from its stored copy (that would store the stream, and
    make lossy programs look invertible). A ``reduce_precision`` to the
    dtype's own precision is the identity, and it passes derivatives, so the
    results made from the copy still count as depending on ``x``."""
    info = jnp.finfo(x.dtype)
    return lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def at_point(e, rebuilt: Sequence[int]) -> tuple[Callable, Callable]:
    """``e`` evaluated, with its derivative, at stored copies of its inputs.

    Args:
      e: the equation.
      rebuilt: positions of its inputs that the backward pass rebuilds; those
        are stored.

    Returns:
      ``(decide, values)``: ``decide(*rebuilt inputs)`` copies them (what the
      forward pass stores); ``values(*ins, *copies)`` gives ``e``'s results at
      the copies, and sends its cotangents to ``ins``.
    """
    rebuilt = list(rebuilt)

    def merged(ins, copies):
        args = list(ins)
        for n, c in zip(rebuilt, copies):
            args[n] = c
        return args

    @jax.custom_vjp
    def run(ins, copies):
        return apply_eqn(e, merged(ins, copies))

    def fwd(ins, copies):
        return run(ins, copies), (ins, copies)

    def bwd(res, cts):
        ins, copies = res
        args = merged(ins, copies)
        _, vjp = vjp_eqn(e, args)
        got = [None] * len(args) if vjp is None else vjp(list(cts))
        zero = [cotangents.zeros(jax.typeof(x)) for x in args]
        in_cts = [z if g is None else g for g, z in zip(got, zero)]
        return in_cts, [cotangents.zeros(jax.typeof(c)) for c in copies]

    run.defvjp(fwd, bwd)

    def decide(*xs):
        return [_copy(x) for x in xs]

    def values(*args):
        ins, copies = args[: len(e.invars)], args[len(e.invars) :]
        return list(run(list(ins), list(copies)))

    return decide, values
