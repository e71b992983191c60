"""The checkpoint mode: carries recomputed from a few snapshots.

For a body that cannot be inverted (or one whose inverse is ill-conditioned),
the forward pass saves the initial carry (and the trip count, ``xs``, the
constants); the backward pass recomputes carries from at most ``slots``
snapshots by the binomial schedule of :mod:`.revolve` and takes the body's
VJP at each step, from the last step to the first. Recomputation is exact,
so this mode stores no decisions and no anchors. The same backward serves
``scan`` (its length known at trace time) and ``while_loop`` (its trip count
read at run time).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax import lax

from revnet._engine import cotangents
from revnet._engine import jaxpr as jx
from revnet._engine import perturbed as pb
from revnet._engine.interpreter import evaluate
from revnet._engine.loops import revolve


def backward(
    sp: jx.ScanParams,
    consts: Sequence[Any],
    xs: Sequence[Any],
    init: Sequence[Any],
    steps: Any,
    cts: tuple[Sequence[Any], Sequence[Any]],
    perturbed: tuple[Sequence[bool], Sequence[bool], Sequence[bool]],
    slots: int,
) -> tuple[list, list, list]:
    """The cotangents of a loop's constants, initial carry and ``xs``.

    Args:
      sp: the loop as a scan; ``sp.length`` is None for a while loop, whose
        trip count is ``steps``.
      consts, xs: the body's constants and the stacked ``xs`` (none for a
        while loop).
      init: the initial carry.
      steps: a while loop's trip count (an int32 scalar); None for a scan.
      cts: the cotangents of the final carry and of ``ys``.
      perturbed: which constants, initial carry leaves and ``xs`` are
        differentiated.
      slots: how many carries the backward pass may hold, ``init`` included.

    Returns:
      ``(constants, initial carry, xs)`` cotangents, None where zero.

    Example::

        ct_k, ct_c, ct_x = backward(sp, consts, xs, init, None, cts, flags, 4)
    """
    body, nk, nc = sp.body.jaxpr, sp.num_consts, sp.num_carry
    n = steps if sp.length is None else sp.length
    ct_final, ct_ys = cts
    if sp.length == 0:  # no step: the carry passes through, nothing else is read
        return [None] * nk, list(ct_final), [None] * len(xs)
    ct_ys = cotangents.drop_float0(ct_ys)
    k_avals = [jx.aval(v) for v in body.invars[:nk]]
    c_avals = [jx.aval(v) for v in body.invars[nk : nk + nc]]
    x_avals_t = [jx.aval(v) for v in body.invars[nk + nc :]]
    x_avals = [jx.stacked(a, sp.length) for a in x_avals_t]
    out_avals = [jx.aval(v) for v in body.outvars]

    def at(t):
        return n - 1 - t if sp.reverse else t

    def row(stack, t):
        return [lax.dynamic_index_in_dim(a, at(t), keepdims=False) for a in stack]

    def step(*args):
        return evaluate(body, args)

    def advance(t, c):
        return step(*consts, *c, *row(xs, t))[:nc]

    p_k, p_c, p_x = (list(p) for p in perturbed)
    p_c = pb.loop_carry(body, p_k, p_c, p_x)

    def vjp_step(t, c, state):
        ctc, ctk, ctx = state
        cty = [None if a is None else row([a], t)[0] for a in ct_ys]
        in_cts = cotangents.vjp(
            step,
            [*consts, *c, *row(xs, t)],
            out_avals,
            [*ctc, *cty],
            [*p_k, *p_c, *p_x],
        )
        in_cts = cotangents.float_or_none(in_cts, k_avals + c_avals + x_avals_t)
        ctx = [
            a if a is None else lax.dynamic_update_index_in_dim(a, g, at(t), 0)
            for a, g in zip(ctx, in_cts[nk + nc :])
        ]
        return in_cts[nk : nk + nc], cotangents.add_into(ctk, in_cts[:nk]), ctx

    state = (
        cotangents.float_or_none(list(ct_final), c_avals),
        cotangents.float_or_none([None] * nk, k_avals),
        cotangents.float_or_none([None] * len(x_avals), x_avals),
    )
    ct_init, ct_k, ct_xs = revolve.reverse(advance, vjp_step, init, n, slots, state)
    return ct_k, ct_init, ct_xs
