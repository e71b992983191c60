"""A memory budget (``revnet.Budget``): the plan found by compiling.

The plan found is within the budget and the most it can be: one more stored
layer (or, with as many stored, one more recomputed layer) would not fit.
A budget below the all-invert plan is refused in one line naming the
smallest budget that fits, and that budget is accepted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import revnet
from revnet._layers import budget, stack
from revnet._layers.options import StackOptions
from tests.helpers import assert_trees_close, tolerance

DEPTH, BATCH, WIDTH = 6, 64, 16


def _layer(w, state, key, h):
    h1, h2 = jnp.split(h, 2, axis=-1)
    y1 = h1 + jnp.tanh(jnp.tanh(h2 @ w[0]) @ w[1])
    y2 = h2 + jnp.tanh(y1 @ w[2])
    return jnp.concatenate([y1, y2], -1), state


def _inputs(dtype=jnp.float32):
    k = jax.random.key(0)
    w = 0.3 * jax.random.normal(k, (DEPTH, 3, WIDTH // 2, WIDTH // 2), dtype)
    x = jax.random.normal(jax.random.key(1), (BATCH, WIDTH), dtype)
    return (w, None, None), x


def _bytes(plan, dtype=jnp.float32) -> int:
    per_layer, x = _inputs(dtype)
    options = StackOptions(plan=plan)

    def outputs(per_layer, h):
        return stack.run_stack(_layer, per_layer, h, options, length=DEPTH)[0]

    return budget.step_bytes(outputs, per_layer, x)


def _plan(limit):
    """The plan the stack takes within ``limit`` bytes (run, so found), read
    from the cache of plans."""
    per_layer, x = _inputs()
    stack.run_stack(_layer, per_layer, x, StackOptions(plan=revnet.Budget(limit)))
    (plan,) = _found(limit, BATCH)
    return plan


def _found(limit: int, batch: int) -> list:
    """The cached plans for ``limit`` bytes of stacks of this batch (keys:
    the structure's text, the depth, the budget, the options)."""
    return [
        plan
        for (text, _, bytes_, *_), plan in budget._PLANS.items()
        if bytes_ == limit and f"f32[{batch},{WIDTH}]" in text
    ]


def test_the_plan_is_the_most_that_fits():
    low, high = _bytes(revnet.StackPlan()), _bytes(revnet.StackPlan(store=DEPTH))
    assert low < high
    plans = set()
    for limit in (low, (2 * low + high) // 3, (low + 2 * high) // 3, high):
        plan = _plan(limit)
        plans.add(plan)
        assert _bytes(plan) <= limit, (limit, plan)
        if plan.store < DEPTH:
            assert _bytes(revnet.StackPlan(plan.store + 1)) > limit, (limit, plan)
        if plan.store + plan.remat < DEPTH:
            more = revnet.StackPlan(plan.store, plan.remat + 1)
            assert _bytes(more) > limit, (limit, plan)
    assert len(plans) >= 3, plans  # the budget moves the plan
    assert _plan(high) == revnet.StackPlan(store=DEPTH)


def test_a_budget_below_the_smallest_plan_is_refused_in_one_line():
    smallest = _bytes(revnet.StackPlan())
    with pytest.raises(ValueError) as info:
        _plan(smallest - 1)
    message = str(info.value)
    assert "\n" not in message
    assert f"revnet.Budget({smallest})" in message, message
    assert _plan(smallest) == revnet.StackPlan()  # the advice, followed


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_gradients_within_a_budget_equal_plain_autodiff(dtype):
    with jax.enable_x64(dtype == jnp.float64):
        per_layer, x = _inputs(dtype)
        low = _bytes(revnet.StackPlan(), dtype)
        high = _bytes(revnet.StackPlan(DEPTH), dtype)
        options = StackOptions(plan=revnet.Budget((low + high) // 2))

        def loss(w, x, options):
            y, _ = stack.run_stack(_layer, (w, None, None), x, options)
            return jnp.sum(jnp.sin(y))

        grad = jax.grad(loss, (0, 1))
        want = grad(per_layer[0], x, StackOptions(reversible=False))
        got = grad(per_layer[0], x, options)
        assert_trees_close(got, want, tolerance(dtype, loops=True), "grads")


def test_a_fraction_needs_a_device_that_reports_its_memory():
    if jax.devices()[0].memory_stats():
        pytest.skip("this device reports its memory")
    per_layer, x = _inputs()
    options = StackOptions(plan=revnet.Budget(0.5))
    with pytest.raises(ValueError, match=r"give the budget in bytes") as info:
        stack.run_stack(_layer, per_layer, x, options, name="seq")
    assert str(info.value).startswith("seq: a budget of 0.5 of the device's memory")


@pytest.mark.parametrize(
    "limit, error, message",
    [
        (0, ValueError, "must be positive"),
        (1.5, ValueError, r"a fraction in \(0, 1\]"),
        ("1GB", TypeError, "a number of bytes"),
        (True, TypeError, "a number of bytes"),
    ],
)
def test_a_bad_budget_is_refused_in_one_line(limit, error, message):
    with pytest.raises(error, match=message):
        revnet.Budget(limit)


def test_haiku_plans_for_the_step_that_trains_not_for_init():
    hk = pytest.importorskip("haiku")
    from revnet import blocks

    def block(h):
        h1, h2 = jnp.split(h, 2, axis=-1)
        y1 = h1 + jnp.tanh(hk.Linear(h2.shape[-1])(h2))
        return jnp.concatenate([y1, h2 + jnp.tanh(hk.Linear(h1.shape[-1])(y1))], -1)

    net = hk.transform(
        lambda x: blocks.ReversibleSequence(block, 4, plan=revnet.Budget(2**30))(x)
    )
    x = jnp.ones((8, WIDTH))
    params = net.init(jax.random.PRNGKey(0), x)
    assert not _found(2**30, 8)
    net.apply(params, None, x)
    assert _found(2**30, 8) == [revnet.StackPlan(store=4)]


def test_a_flow_within_a_budget_has_the_twins_log_det_and_gradients():
    with jax.enable_x64(True):
        per_layer, x = _inputs(jnp.float64)

        def affine(w, state, key, h):
            h1, h2 = jnp.split(h, 2, axis=-1)
            scale = jnp.exp(jnp.tanh(h2 @ w[0]))
            return jnp.concatenate([h2, h1 * scale + jnp.tanh(h2 @ w[1])], -1), state

        def nll(w, x, options):
            y, log_det, _ = stack.run_stack_with_log_det(
                affine, (w, None, None), x, options
            )
            return jnp.sum(y**2) - jnp.sum(log_det), log_det

        grad = jax.grad(nll, (0, 1), has_aux=True)
        want, want_log_det = grad(per_layer[0], x, StackOptions(reversible=False))
        options = StackOptions(plan=revnet.Budget(2**30))
        got, log_det = grad(per_layer[0], x, options)
        assert_trees_close(log_det, want_log_det, 1e-10, "log_det")
        assert_trees_close(got, want, tolerance(jnp.float64, loops=True), "grads")
