"""The boundary check: a reversible backward pass compares the input it
rebuilt with the one its caller passed, by default (revnet._engine.boundary).

A damped step (a factor of modulus below 1, divided by on every reversed
step) makes the rebuilt input, and so the gradients, wrong: the check must
say so in one line, in every kind of reversible call; a well-conditioned one
must pass silently; and the check must cost at most one carry of memory and
2% of the FLOPs of a training step.
"""

from __future__ import annotations

import warnings

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import revnet
from revnet import blocks
from tests.helpers import (
    boundary_check,
    compiled,
    flop_count,
    runtime_checks,
    temp_size,
    tolerance,
)


def _damped(c, w):
    a, b = c
    a = a + jnp.tanh(b * w)
    b = 0.5 * b + a  # undone by dividing by 0.5 at every reversed step
    return (a, b), None


def _coupling(c, w):
    a, b = c
    a = a + jnp.tanh(b * w)
    b = b + jnp.sin(a * w)
    return (a, b), None


def _scan_loss(step, **kw):
    def loss(w, x):
        (a, b), _ = revnet.scan(step, (x, x), w, mode="invert", **kw)
        return jnp.sum(a**2 + b**2)

    return loss


def _while_loss(step):
    def loss(w, x):
        def body(s):
            i, c = s
            return i + 1, step(c, w[i])[0]

        _, (a, b) = revnet.while_loop(
            lambda s: s[0] < w.shape[0], body, (0, (x, x)), mode="invert",
            max_steps=w.shape[0],
        )  # fmt: skip
        return jnp.sum(a**2 + b**2)

    return loss


def _stack(step):
    def stack(c, w):
        return jax.lax.scan(step, c, w)[0]

    f = revnet.invertible(stack, known_argnums=1)

    def loss(w, x):
        a, b = f((x, x), w)
        return jnp.sum(a**2 + b**2)

    return loss


def _plain(step):
    def loss(w, x):
        (a, b), _ = jax.lax.scan(step, (x, x), w)
        return jnp.sum(a**2 + b**2)

    return loss


def _warnings(loss, w, x):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g = jax.jit(jax.grad(loss))(w, x)
        jax.block_until_ready(g)
        jax.effects_barrier()
    found = [str(c.message) for c in caught if c.category is revnet.DriftWarning]
    return g, found


CALLS = {
    "scan": ("revnet.scan(_damped)", _scan_loss),
    "while_loop": ("revnet.while_loop(body)", _while_loss),
    "invertible": ("revnet.invertible(stack)", _stack),
}


@pytest.mark.parametrize("kind", sorted(CALLS))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_damped_step_warns_in_one_line_by_default(kind, dtype):
    name, make = CALLS[kind]
    with jax.enable_x64(dtype == "float64"):
        x = jnp.ones(4, dtype)
        w = jnp.full((120,), 0.3, dtype)
        g, found = _warnings(make(_damped), w, x)
        want = jax.grad(_plain(_damped))(w, x)
    # The gradient is really wrong: the check is not a false alarm.
    assert not np.allclose(g, want, rtol=1e-2)  # wrong by over 1%, not rounding
    assert len(found) == 1, found
    (message,) = found
    assert "\n" not in message
    # It names the call and the user's line of it.
    assert message.startswith(f"revnet: {name} at {__file__}:"), message
    assert ") rebuilt its input with relative error" in message, message
    for words in ("relative error", "modulus below 1", "anchor_every", "checkpoint"):
        assert words in message, (words, message)


@pytest.mark.parametrize("kind", sorted(CALLS))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_well_conditioned_step_passes_silently(kind, dtype):
    _, make = CALLS[kind]
    with jax.enable_x64(dtype == "float64"):
        x = jnp.linspace(-1.0, 1.0, 4, dtype=dtype)
        w = jnp.full((64,), 0.1, dtype)
        g, found = _warnings(make(_coupling), w, x)
        want = jax.grad(_plain(_coupling))(w, x)
    assert not found, found
    rtol = (
        1e-4  # float32, elementwise (no floor) through 64 rebuilt steps
        if dtype == "float32"
        else tolerance(dtype, loops=True)
    )
    np.testing.assert_allclose(g, want, rtol=rtol)


def test_raise_and_off():
    x, w = jnp.ones(4), jnp.full((120,), 0.3)
    with boundary_check("raise"):
        loss = _scan_loss(_damped)
        with pytest.raises(Exception, match="rebuilt its input with relative error"):
            jax.block_until_ready(jax.jit(jax.grad(loss))(w, x))
            jax.effects_barrier()
    with boundary_check("off"):
        _, found = _warnings(_scan_loss(_damped), w, x)
    assert not found
    with pytest.raises(ValueError, match="set_boundary_check: mode must be one of"):
        revnet.set_boundary_check("loud")


def test_raise_eagerly_is_revnets_own_one_line_error():
    """Without ``jit`` the backward pass's check raises :class:`DriftError`
    itself, not a backend's callback error around it."""
    x, w = jnp.ones(4), jnp.full((120,), 0.3)
    with boundary_check("raise"):
        with pytest.raises(revnet.DriftError) as info:
            jax.grad(_scan_loss(_damped))(w, x)
    assert "\n" not in str(info.value)
    assert str(info.value).startswith("revnet: revnet.scan(_damped) at ")


def _auto_loss(step, factor):
    def loss(w, x):
        def damped(c, w):
            a, b = c
            a = a + jnp.tanh(b * w)
            return (a, factor * b + a), None

        (a, b), _ = revnet.scan(damped, (x, x), w, mode="auto")
        return jnp.sum(a**2 + b**2)

    return loss


@pytest.mark.parametrize("closed_over", [False, True])
def test_auto_arms_the_check_for_damping_visible_at_trace_time(closed_over):
    """With the check off, ``mode="auto"`` still checks a step it inverts
    that divides by a known factor below 1 (a literal, or an array the body
    closes over); an explicit ``mode="invert"`` does as the user set."""
    x, w = jnp.ones(4), jnp.full((120,), 0.3)
    factor = np.full(4, 0.5, np.float32) if closed_over else 0.5
    with boundary_check("off"):
        _, found = _warnings(_auto_loss(_damped, factor), w, x)
        _, quiet = _warnings(_scan_loss(_damped), w, x)
        # An amplifying factor is inverted stably: not armed.
        _, stable = _warnings(_auto_loss(_damped, 2.0), jnp.full((8,), 0.3), x)
    assert len(found) == 1 and "checked although the check is off" in found[0]
    assert not quiet and not stable


def test_small_fields_beside_a_large_constant_leaf_are_checked_leaf_by_leaf():
    """Fields that start at zero, driven by a small source and damped, next
    to a large leaf the step passes through (a material's permittivity): over
    all leaves together the rebuilt fields' error is nothing beside that leaf,
    but each leaf is measured against its own size at the loop's ends."""

    def step(c, w):
        a, b, eps = c
        a = a + jnp.tanh(b * w) / eps[:4] + 1e-10
        return (a, 0.5 * b + a, eps), None

    def loss(scan):
        def f(w, x):
            (a, b, _), _ = scan(step, (0 * x, 0 * x, jnp.full(64, 1e3)), w)
            return jnp.sum(a**2 + b**2)

        return f

    def inverted(*a):
        return revnet.scan(*a, mode="invert")

    x, w = jnp.ones(4), jnp.full((30,), 0.3)
    g, found = _warnings(loss(inverted), w, x)
    want = jax.grad(loss(jax.lax.scan))(w, x)
    off = np.max(np.abs(g - want)) / np.max(np.abs(want))
    assert off > 1e-2, off  # really wrong
    assert len(found) == 1 and "rebuilt its input" in found[0], found


def test_with_anchors_the_message_names_the_first_anchor_past_the_tolerance():
    """The backward pass runs from the end: the anchor past the tolerance that
    it meets first is the last one in step order (read here from a monitor
    beside the check, which sees the same readings)."""
    x = jnp.ones(4)
    w = jnp.concatenate([jnp.full((80,), 0.3), jnp.zeros(40)])
    monitor = revnet.DriftMonitor()
    _, found = _warnings(_scan_loss(_damped, anchor_every=40, drift=monitor), w, x)
    drift = monitor.latest
    tol = np.finfo(np.float32).eps ** 0.5
    assert drift.shape == (3,) and np.any(drift > tol), drift
    step = 40 * int(np.flatnonzero(~(drift <= tol))[-1])
    assert len(found) == 1, found
    assert f"first past it at the anchor before step {step})" in found[0], found
    assert "a smaller anchor_every" in found[0]


def test_the_tolerance_is_half_the_digits_of_the_carry_dtype():
    tol = revnet._engine.boundary.tolerance
    assert tol([jnp.ones(2, jnp.float32)]) == pytest.approx(np.finfo("f4").eps ** 0.5)
    assert tol([jnp.ones(2), jnp.ones(2, jnp.float64)]) == pytest.approx(
        np.finfo("f4").eps ** 0.5
    )


# -- cost ----------------------------------------------------------------------- #


def _mlp_stack(depth):
    def block(h):
        half = h.shape[-1] // 2
        mlp = lambda u: hk.nets.MLP([64, half], activation=jnp.tanh)(u)  # noqa: E731
        return blocks.AdditiveCoupling(mlp, mlp)(h)

    return hk.transform_with_state(lambda x: blocks.ReversibleSequence(block, depth)(x))


@pytest.mark.parametrize("where", ["argument", "intermediate"])
def test_the_check_costs_at_most_one_carry_and_two_percent_of_flops(where):
    """Compiled ``jit(grad)`` of a depth-8 coupling stack (batch 256, width
    64), check on against off: the input the check keeps is one carry when it
    is computed inside the step, and nothing when it is the step's argument."""
    net = _mlp_stack(8)
    x = jax.ShapeDtypeStruct((256, 64), jnp.float32)
    params, state = jax.eval_shape(net.init, jax.random.PRNGKey(0), x)

    def loss(params, state, x):
        h = jnp.tanh(x) if where == "intermediate" else x
        return jnp.sum(jnp.sin(net.apply(params, state, None, h)[0]))

    programs = {}
    for mode in ("off", "warn"):
        with boundary_check(mode), runtime_checks(False):
            fn = jax.grad(lambda *a: loss(*a))  # a new function: traced anew
            programs[mode] = compiled(fn, params, state, x)
    # One carry, and the reading: a float32 scalar, which XLA aligns to 64 bytes.
    carry = 256 * 64 * 4
    extra = temp_size(programs["warn"]) - temp_size(programs["off"])
    assert extra <= carry + 64, (extra, carry)
    ratio = flop_count(programs["warn"]) / flop_count(programs["off"])
    assert ratio <= 1.02, ratio
