"""diffrax's reversible Heun solver in every revnet configuration, 1k and 10k
steps.

A neural ODE (a tanh MLP vector field, state of 4, width 16) stepped by
diffrax's own ``ReversibleHeun().step``, unchanged, with its solver state
``(yhat, vf)`` in the carry; and reversible Heun written as couplings on
``(y, yhat)``, which revnet inverts (two vector-field evaluations a step where
diffrax's step makes one: it carries the last one). The reference is diffrax's
own ``diffeqsolve`` with ``RecursiveCheckpointAdjoint`` where it is the same
float program, and ``jax.checkpoint`` over ``lax.scan`` of the step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

import revnet
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
    if form == "diffrax":
        assert by_mode["invert"] == {"refused"}  # the carried vector field
        assert by_mode["store"] == {"within"}, outcomes  # it stores that
    elif steps == 1_000:
        assert by_mode["invert"] == {"within"}, outcomes


def test_the_scan_of_diffraxs_step_is_diffraxs_own_solve():
    """The reference program is diffrax's: ``diffeqsolve`` with its recursive
    checkpointing gives the same gradient as the scanned step."""
    with jax.enable_x64(True):
        p, steps = _params("float64"), 50
        sol = functools.partial(
            diffrax.diffeqsolve,
            diffrax.ODETerm(_vf),
            diffrax.ReversibleHeun(),
            t0=0.0,
            t1=steps * DT,
            dt0=DT,
            saveat=diffrax.SaveAt(t1=True),
            adjoint=diffrax.RecursiveCheckpointAdjoint(),
            max_steps=steps,
        )

        def own(p):
            return jnp.sum(sol(y0=p["y0"], args=p).ys[-1] ** 2)

        want = jax.grad(own)(p)
        got = jax.grad(functools.partial(_heun_loss(steps), revnet.scan))(p)
    assert peers.relative(got, want) < 1e-12
