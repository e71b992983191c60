"""diffrax's reversible Heun solver in every revnet configuration, 1k and 10k
steps.

A neural ODE (a tanh MLP vector field, state of 4, width 16) stepped by
diffrax's own ``ReversibleHeun().step``, unchanged, with its solver state
``(yhat, vf)`` in the carry: revnet inverts it at one vector-field evaluation a
step (the carried evaluation is a derived leaf, and ``yhat0`` is solved from
two equations together); and reversible Heun written as couplings on
``(y, yhat)`` (two evaluations a step). The reference is diffrax's own
``diffeqsolve`` with ``RecursiveCheckpointAdjoint`` where it is the same
float program, and ``jax.checkpoint`` over ``lax.scan`` of the step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

import revnet
from revnet._engine.loops.hooks import modes_chosen
from tests.helpers import equations, equations_of
from tests.simulation import peers

diffrax = peers.require("diffrax")

DIM, WIDTH, DT = 4, 16, 0.01


def _params(dtype):
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {
        "w1": (jax.random.normal(k1, (DIM, WIDTH)) / DIM**0.5).astype(dtype),
        "w2": (jax.random.normal(k2, (WIDTH, DIM)) / WIDTH**0.5).astype(dtype),
        "y0": jnp.linspace(-1.0, 1.0, DIM, dtype=dtype),
    }


def _vf(t, y, p):
    return jnp.tanh(y @ p["w1"]) @ p["w2"] - 0.1 * y


def _times(steps, dtype):
    ts = jnp.arange(steps + 1, dtype=dtype) * jnp.asarray(DT, dtype)
    return jnp.stack([ts[:-1], ts[1:]], axis=1)


def _heun_loss(steps):
    term, solver = diffrax.ODETerm(_vf), diffrax.ReversibleHeun()

    def loss(scan, p):
        def step(carry, t01):
            y, state = carry
            y, _, _, state, _ = solver.step(
                term, t01[0], t01[1], y, p, state, made_jump=False
            )
            return (y, state), None

        dtype = p["y0"].dtype
        t0, t1 = jnp.asarray(0.0, dtype), jnp.asarray(DT, dtype)
        init = (p["y0"], solver.init(term, t0, t1, p["y0"], p))
        (y, _), _ = scan(step, init, _times(steps, dtype))
        return jnp.sum(y**2)

    return loss


def _coupling_loss(steps):
    def loss(scan, p):
        def step(carry, t01):
            y, yhat = carry
            h = 0.5 * (t01[1] - t01[0])
            a = y + h * _vf(t01[0], yhat, p)
            yhat = 2 * a - yhat
            return (a + h * _vf(t01[1], yhat, p), yhat), None

        (y, _), _ = scan(step, (p["y0"], p["y0"]), _times(steps, p["y0"].dtype))
        return jnp.sum(y**2)

    return loss


def _nudge(p):
    return dict(p, y0=peers.nudged(p["y0"]))


@pytest.mark.slow
@pytest.mark.parametrize("steps", [1_000, 10_000])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("form", ["diffrax", "coupling"])
def test_every_configuration_gives_the_gradient_or_one_line(form, dtype, steps):
    make = _heun_loss if form == "diffrax" else _coupling_loss
    with jax.enable_x64(dtype == "float64"):
        outcomes = peers.check_all(make(steps), _params(dtype), _nudge, anchor=100)
    by_mode = {}
    for options, result in outcomes.items():
        by_mode.setdefault(dict(options)["mode"], set()).add(result)
    assert by_mode["checkpoint"] == {"within"}, outcomes
    if steps == 1_000:
        assert by_mode["invert"] == {"within"}, outcomes


def _evaluations(fun, *args) -> list[int]:
    """The number of ``tanh`` (one per vector-field evaluation) in the body of
    each scan of ``fun``'s program."""
    return [
        sum(x.primitive.name == "tanh" for x in equations_of(e.params["jaxpr"].jaxpr))
        for e in equations(fun, *args)
        if e.primitive.name == "scan"
    ]


def test_diffraxs_step_inverts_unchanged_at_one_evaluation_a_step():
    with jax.enable_x64(True):
        p, steps = _params("float64"), 200
        inverted = functools.partial(revnet.scan, mode="invert")
        loss = functools.partial(_heun_loss(steps), inverted)
        with modes_chosen() as seen:
            counts = _evaluations(loss, p)
        (mode,) = seen
        # the solver state (yhat, vf) follows y: vf is derived from yhat
        assert mode.kind == "invert" and mode.derived.mask == (False, False, True)
        # The forward loop is diffrax's step: one evaluation a step.
        assert counts == [1], counts
        got = jax.grad(functools.partial(_heun_loss(steps), inverted))(p)
        want = jax.grad(functools.partial(_heun_loss(steps), jax.lax.scan))(p)
        assert peers.relative(got, want) < 1e-12  # float64, tighter than the table


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_rebuilt_initial_state_is_within_the_solvers_float_error(dtype):
    """The backward pass rebuilds the initial state from the state 1,000 steps
    later to within the rounding those steps accumulate: at most one unit of
    the dtype's rounding per step (measured: 3.5e-5 in float32, 4.9e-15 in
    float64, against bounds of 1.2e-4 and 2.2e-13)."""
    steps = 1_000
    monitor = revnet.DriftMonitor()

    def anchored(*a, **k):
        return revnet.scan(*a, **k, mode="invert", anchor_every=steps, drift=monitor)

    with jax.enable_x64(dtype == "float64"):
        jax.grad(functools.partial(_heun_loss(steps), anchored))(_params(dtype))
        jax.effects_barrier()
    (rebuilt,) = [float(d) for d in monitor.latest]  # the initial carry's
    assert rebuilt <= steps * float(jnp.finfo(dtype).eps), rebuilt
