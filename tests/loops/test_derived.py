"""Derived carry leaves: a step that overwrites a leaf with a function of its
new carry (a force from the new positions) inverts, the leaf rebuilt by the
equations of the step before.

Gradients are compared with plain ``jax.grad`` of the same loop under
``lax.scan`` (or ``fori_loop``), for every leaf, in float32 and float64.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import revnet
from revnet._engine.loops.hooks import modes_chosen
from tests.helpers import assert_trees_close, temp_bytes, tolerance

DT = 0.01


def _force(w):
    return lambda x, t: -jnp.sin(w * x) * jnp.cos(t)


def _verlet(w, clock=None):
    """Velocity Verlet in its natural form: the force at the new positions is
    carried to the next step, which reads it before computing its own."""
    force = _force(w)

    def step(carry, t):
        x, p, f = carry
        p = p + 0.5 * DT * f
        x = x + DT * p
        f = force(x, t)  # overwritten: no output determines the old force
        p = p + 0.5 * DT * f
        return (x, p, f), jnp.sum(x * p)

    return step


def _scan_loss(scan, x0, p0, w, ts, *, reverse=False):
    (x, p, f), ys = scan(_verlet(w), (x0, p0, _force(w)(x0, 0.3)), ts, reverse=reverse)
    return jnp.sum(x**2) + jnp.sum(p * f) + jnp.sum(ys * ts)


def _args(dtype):
    return (
        jnp.linspace(0.0, 1.0, 5, dtype=dtype),
        jnp.linspace(1.0, -0.5, 5, dtype=dtype),
        jnp.asarray(1.3, dtype),
        jnp.linspace(0.0, 3.0, 60, dtype=dtype),
    )


def _inverting(*a, **k):
    return revnet.scan(*a, **k, mode="invert")


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_carried_force_is_derived_and_the_scan_inverts(dtype, reverse):
    with jax.enable_x64(dtype == "float64"):
        args = _args(dtype)
        argnums = (0, 1, 2, 3)
        want = jax.grad(
            functools.partial(_scan_loss, jax.lax.scan, reverse=reverse), argnums
        )(*args)
        with modes_chosen() as seen:
            got = jax.jit(
                jax.grad(
                    functools.partial(_scan_loss, _inverting, reverse=reverse), argnums
                )
            )(*args)
        (mode,) = seen
        assert mode.kind == "invert" and mode.derived.mask == (False, False, True)
        assert_trees_close(got, want, tolerance(dtype, loops=True), "gradient")


def test_the_previous_steps_xs_rebuild_the_derived_leaf():
    """The force of step ``i``'s input was computed at step ``i - 1``'s time:
    rebuilding it at step ``i``'s own time would give another gradient."""
    with jax.enable_x64(True):
        x0, p0, w, ts = _args("float64")
        ts = ts**2  # times far apart: cos(t) differs from step to step
        argnums = (0, 1, 2, 3)
        want = jax.grad(functools.partial(_scan_loss, jax.lax.scan), argnums)(
            x0, p0, w, ts
        )
        got = jax.grad(functools.partial(_scan_loss, _inverting), argnums)(
            x0, p0, w, ts
        )
        assert_trees_close(got, want, tolerance("float64", loops=True), "gradient")


def _while_loss(loop, x0, p0, w, steps=40):
    force = _force(w)

    def body(c):
        i, x, p, f = c
        p = p + 0.5 * DT * f
        x = x + DT * p
        f = force(x, 0.05 * jnp.astype(i + 1, x.dtype))
        return i + 1, x, p + 0.5 * DT * f, f

    _, x, p, f = loop(lambda c: c[0] < steps, body, (0, x0, p0, force(x0, 0.0)))
    return jnp.sum(x**2) + jnp.sum(p * f)


@pytest.mark.parametrize("max_steps", [None, 64])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_while_loop_with_a_carried_force_inverts(dtype, max_steps):
    def reference(cond, body, init):
        return jax.lax.while_loop(cond, body, init)

    def inverted(cond, body, init):
        return revnet.while_loop(cond, body, init, mode="invert", max_steps=max_steps)

    with jax.enable_x64(dtype == "float64"):
        x0, p0, w, _ = _args(dtype)
        # plain autodiff differentiates a fixed trip count: fori_loop's scan
        want = jax.grad(
            lambda *a: _while_loss(
                lambda c, b, i: jax.lax.fori_loop(0, 40, lambda _, s: b(s), i), *a
            ),
            (0, 1, 2),
        )(x0, p0, w)
        with modes_chosen() as seen:
            got = jax.jit(
                jax.grad(functools.partial(_while_loss, inverted), (0, 1, 2))
            )(x0, p0, w)
        (mode,) = seen
        assert mode.derived.mask == (False, False, False, True), mode
        assert_trees_close(got, want, tolerance(dtype, loops=True), "gradient")


def test_a_leaf_read_through_another_derived_leaf_is_derived_too():
    force = _force(1.1)

    def step(c, _):
        x, p, f, e = c
        p = p + DT * f
        x = x + DT * p
        f = force(x, 0.0)
        return (x, p, f, jnp.sum(f * f)), None  # e: from the new force

    def loss(scan, x0, p0):
        init = (x0, p0, force(x0, 0.0), jnp.sum(force(x0, 0.0) ** 2))
        (x, p, f, e), _ = scan(step, init, None, length=30)
        return jnp.sum(x * p) + e

    with jax.enable_x64(True):
        x0, p0, _, _ = _args("float64")
        want = jax.grad(functools.partial(loss, jax.lax.scan), (0, 1))(x0, p0)
        with modes_chosen() as seen:
            got = jax.grad(functools.partial(loss, _inverting), (0, 1))(x0, p0)
        assert seen[0].derived.mask == (False, False, True, True)
        assert_trees_close(got, want, tolerance("float64", loops=True), "gradient")


def test_a_leaf_computed_from_the_old_carry_is_not_derived():
    force = _force(1.1)

    def lagged(c, _):
        x, p, f = c
        p = p + 0.5 * DT * f
        f = force(x, 0.0)  # from the old positions: the step before never saw them
        x = x + DT * p
        return (x, p + 0.5 * DT * f, f), None

    x0 = jnp.linspace(0.0, 1.0, 5)
    with pytest.raises(revnet.NotInvertibleError, match="overwrites input init"):
        revnet.scan(lagged, (x0, x0, force(x0, 0.0)), None, length=3, mode="invert")


def test_a_derived_leaf_keeps_the_backward_pass_flat_in_the_steps():
    def loss(steps, x0, p0, w):
        ts = jnp.linspace(0.0, 3.0, steps)
        return _scan_loss(_inverting, x0, p0, w, ts)

    x0, p0, w, _ = _args("float32")
    x0, p0 = jnp.tile(x0, 200), jnp.tile(p0, 200)
    grad = jax.grad(loss, (1, 2, 3))
    small = temp_bytes(functools.partial(grad, 100), x0, p0, w)
    large = temp_bytes(functools.partial(grad, 1000), x0, p0, w)
    # xs (the times) and their cotangents grow, 4 bytes a step each: the
    # carry (3 x 4 KB) is not stored per step.
    assert large - small <= 2 * 4 * 900 + 1024, (small, large)
    assert np.all(np.isfinite(jax.grad(functools.partial(loss, 100))(x0, p0, w)))


def test_a_derived_leaf_is_found_inside_a_jitted_step_with_constants():
    """A library's step, jitted once with its constants closed over (jax-md's
    ``step_fn``), is looked into: its force is derived as well."""
    w = jnp.asarray([1.3, 0.7, 1.1, 0.9, 1.2])  # a concrete constant of the jit
    step = jax.jit(_verlet(w))

    def loss(scan, x0, p0, ts):
        init = (x0, p0, _force(w)(x0, 0.3))
        (x, p, f), ys = scan(step, init, ts)
        return jnp.sum(x**2) + jnp.sum(p * f) + jnp.sum(ys)

    with jax.enable_x64(True):
        x0, p0, _, ts = _args("float64")
        want = jax.grad(functools.partial(loss, jax.lax.scan), (0, 1))(x0, p0, ts)
        with modes_chosen() as seen:
            got = jax.grad(functools.partial(loss, _inverting), (0, 1))(x0, p0, ts)
        assert seen[0].derived.mask == (False, False, True)
        assert_trees_close(got, want, tolerance("float64", loops=True), "gradient")
