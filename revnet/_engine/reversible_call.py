"""The reversible call: ``jaxpr`` with the VJP that rebuilds its inputs.

:func:`call` evaluates a traced program whose plan rebuilds the inputs from
the outputs. Under ``jax.grad`` its forward pass saves the outputs, the
constants and the stored decisions; the backward pass runs the plan
backwards with the cotangents. Under ``jax.vmap`` it is rebuilt on the
batched program (``jax.vmap`` of the program, the constants closed over) and
called again through the front-end that made it, so the batch is ONE
reversible call and the cotangents of unbatched weights are summed inside
each step, not held once per example.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from revnet._engine import boundary, cotangents, perturbed, runtime_checks
from revnet._engine import jaxpr as jx
from revnet._engine.decisions import residuals
from revnet._engine.interpreter import Interpreter
from revnet._engine.plan import Plan


def vjp_function(
    jaxpr: Any, exposed: Any, plan: Plan, n_consts: int, name: str = "function"
) -> Callable[..., Any]:
    """``run(consts, args)`` evaluating ``jaxpr``, with the inverting VJP.

    The forward pass of a differentiated call evaluates ``exposed.jaxpr``,
    ``jaxpr`` with its stored decisions as extra outputs, and saves those too;
    ``plan`` rebuilds the inputs of ``exposed.jaxpr``. Unless the boundary
    check is off (:mod:`.boundary`), the forward pass also saves the inputs
    the plan rebuilds, and the backward pass compares its rebuilt ones with
    them (``name``: the function, in the message).
    """
    n_out = len(jaxpr.outvars)
    # The boundary check: the inputs the plan rebuilds, against the caller's.
    rebuilt = [not k for k in plan.known_in[n_consts:]]
    avals = [jx.aval(v) for v, r in zip(jaxpr.invars[n_consts:], rebuilt) if r]
    report = boundary.reporter(f"revnet.invertible({name})", avals) if avals else None

    @jax.custom_vjp
    def run(consts, args):
        return jx.eval_body(jx.Body(jaxpr, ()), *consts, *args)

    def fwd(consts, args):
        # Only the perturbed inputs are differentiated (symbolic zeros).
        (consts, args), flags = perturbed.split_primals((consts, args))
        outs = jx.eval_body(jx.Body(exposed.forward_jaxpr, ()), *consts, *args)
        given = [a for a, r in zip(args, rebuilt) if r] if report else None
        residuals.invertible(exposed, consts, outs, given)  # a report, a warning
        return outs[:n_out], (consts, outs, given, perturbed.Flags(flags))

    def bwd(res, cts):
        consts, outs, given, flags = res
        interp = Interpreter(
            plan,
            exposed.jaxpr,
            list(consts),
            list(outs),
            flags.value,
            stored=exposed.n,
        )
        cts = cotangents.drop_float0(perturbed.drop_symbolic_zeros(list(cts)))
        cts = [*cts, *[None] * exposed.n]
        with runtime_checks.scope() as sc:
            values, in_cts = interp.backward(cts, need_values=given is not None)
        runtime_checks.raise_if_failed(sc)
        if given is not None:
            _, drift = boundary.distances(values, given)
            runtime_checks.host_callback(report, drift[None], 1)
        full = cotangents.fill(in_cts, [jx.aval(v) for v in jaxpr.invars])
        return full[:n_consts], full[n_consts:]

    run.defvjp(fwd, bwd, symbolic_zeros=True)
    return run


def call(
    jaxpr: Any,
    program: Any,
    exposed: Any,
    plan: Plan,
    consts: Sequence[Any],
    args: Sequence[Any],
    again: Callable[[Callable[..., Any], list], list],
    name: str = "function",
) -> list[Any]:
    """``jaxpr``'s outputs on ``consts`` and ``args``, with the inverting VJP.

    ``program`` is ``jaxpr`` as traced (:func:`~revnet._engine.trace_program`):
    batched, its nested revnet calls batch themselves. ``again(flat_fun,
    flat_args)`` makes the call anew for another program
    (the front-end's whole path: trace, analyse, call); a ``jax.vmap`` of
    this call calls it on the batched program. ``name``: the function, in
    messages.
    """
    n_consts = len(consts)
    run = vjp_function(jaxpr, exposed, plan, n_consts, name)

    def flat_run(*a):
        return run(list(a[:n_consts]), list(a[n_consts:]))

    def rebatch(axis, values, dims):
        size = axis.size
        held, xs = values[:n_consts], values[n_consts:]
        held_dims = dims[:n_consts]
        # An unbatched rebuilt input is broadcast: the call rebuilds the batch.
        xs = [
            x if d is not None else jx.vmappable.broadcast(x, size)
            for x, d in zip(xs, dims[n_consts:])
        ]
        x_dims = [0 if d is None else d for d in dims[n_consts:]]

        def one(c, a):
            return jx.eval_body(jx.Body(program, ()), *c, *a)

        opts = jx.vmappable.vmap_options(axis)
        in_axes = (held_dims, x_dims)
        # Outputs that do not depend on the example stay unbatched.
        out_axes = jx.vmappable.out_axes(one, in_axes, opts, list(held), xs)

        def batched(*bxs):
            vmapped = jax.vmap(one, in_axes=in_axes, out_axes=out_axes, **opts)
            return vmapped(list(held), list(bxs))

        return again(batched, xs), out_axes

    out_avals = [jx.aval(v) for v in jaxpr.outvars]
    return jx.vmappable.call(flat_run, rebatch, [*consts, *args], out_avals)
