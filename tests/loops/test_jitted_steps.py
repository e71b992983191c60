"""A time-stepper's step wrapped in ``jax.jit`` or ``eqx.filter_jit`` is
analysed the same wherever it was built: outside the differentiated function
(as libraries build and cache theirs), or inside ``jit(grad(...))``; eagerly or
under ``jit``; by ``revnet.scan`` and by ``revnet.inverse``."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import revnet
from tests.helpers import assert_trees_close, tolerance

STEPS = 6


def _make_step(wrap, dt=0.05):
    """A velocity-Verlet step whose force closes over an array (as a library's
    force function closes over its parameters), wrapped in ``wrap``."""
    stiffness = jnp.linspace(1.0, 2.0, 3)

    def force(x):
        return -stiffness * jnp.sin(x)

    def step(state):
        x, v = state
        v = v + 0.5 * dt * force(x)
        x = x + dt * v
        v = v + 0.5 * dt * force(x)
        return x, v

    return wrap(step)


def _loss(scan, step, state):
    def body(c, _):
        return step(c), None

    (x, v), _ = scan(body, state, None, length=STEPS)
    return jnp.sum(jnp.sin(x)) + jnp.sum(v * v)


def _inverted(body, init, xs, length):
    return revnet.scan(body, init, xs, length=length, mode="invert")


WRAPS = {"jax.jit": jax.jit, "eqx.filter_jit": eqx.filter_jit}


@pytest.mark.parametrize("wrap", list(WRAPS))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_jitted_step_is_inverted_wherever_it_was_built(wrap, dtype):
    with jax.enable_x64(dtype == "float64"):
        x0 = jnp.linspace(-1.0, 1.0, 3, dtype=dtype)
        state = (x0, 0.5 * x0)
        built_outside = _make_step(WRAPS[wrap])
        want = jax.grad(lambda s: _loss(jax.lax.scan, built_outside, s))(state)
        got = {
            "built outside, eager": jax.grad(
                lambda s: _loss(_inverted, built_outside, s)
            )(state),
            "built outside, jit(grad)": jax.jit(
                jax.grad(lambda s: _loss(_inverted, built_outside, s))
            )(state),
            "built inside jit(grad)": jax.jit(
                jax.grad(lambda s: _loss(_inverted, _make_step(WRAPS[wrap]), s))
            )(state),
        }
        for where, g in got.items():
            assert_trees_close(g, want, tolerance(dtype), where)
        # And its inverse, from a step built outside.
        inv = revnet.inverse(built_outside, state)
        (rebuilt,) = inv(built_outside(state))
        assert_trees_close(rebuilt, state, tolerance(dtype), "inverse", floor=0)


def test_a_jitted_step_that_cannot_be_inverted_is_refused_the_same_everywhere():
    """The same refusal wherever the jitted step was built."""

    def make():
        @jax.jit
        def step(state):
            x, v = state
            return x + v, jnp.floor(v)  # v is lost

        return step

    outside = make()
    state = (jnp.ones(3), jnp.ones(3))
    messages = []
    for run in (
        lambda: jax.grad(lambda s: _loss(_inverted, outside, s))(state),
        lambda: jax.jit(jax.grad(lambda s: _loss(_inverted, make(), s)))(state),
        lambda: revnet.inverse(outside, state),
    ):
        with pytest.raises(revnet.NotInvertibleError) as info:
            run()
        messages.append(str(info.value))
    # The function named differs (the loop's body, or the step itself).
    first = [m.split(" is not invertible: ")[1].split(" at ")[0] for m in messages]
    assert len(set(first)) == 1, messages
    assert np.all(["floor" in m for m in messages]), messages
