"""A stack's plan (``revnet.StackPlan``) through every front door.

Each door's stack of its own coupling blocks (BatchNorm and dropout in F and
G, ``tests/doors/adapters``) runs with plans that store, recompute and invert
layers in every mix. Whatever the plan, the output, the gradients of every
leaf (parameters and input), the new BatchNorm statistics and the dropout
masks are the non-reversible twin's, in float32 and float64. The two ends of
the range are today's programs: the all-invert plan compiles to the memory
of a stack without a plan, the all-store plan to that of the twin.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import revnet
from revnet._layers import stack
from revnet._layers.options import StackOptions
from tests.doors.test_table import (
    DOORS,
    DTYPES,
    load,
    loss_fn,
    train_step,
    x64,
)
from tests.helpers import (
    assert_trees_close,
    compiled,
    per_example_slogdet,
    runtime_checks,
    temp_size,
    tolerance,
)

DEPTH = 5
PLANS = {
    "invert": revnet.StackPlan(),
    "store": revnet.StackPlan(store=DEPTH),
    "remat": revnet.StackPlan(remat=DEPTH),
    "mixed": revnet.StackPlan(store=2, remat=1),
    "store_one": revnet.StackPlan(store=1),
    "remat_then_invert": revnet.StackPlan(remat=2),
}
TWIN = StackOptions(reversible=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("door", DOORS)
def test_every_plan_equals_the_twin(door, plan, dtype):
    with x64(dtype):
        make = load(door).build
        planned = make(DEPTH, dtype=dtype, reversible=True, plan=PLANS[plan])
        twin = make(DEPTH, dtype=dtype, reversible=False)
        got, want = train_step(planned), train_step(twin)
        rtol = tolerance(dtype, loops=True)
        assert_trees_close(got["y"], want["y"], rtol, "output")
        assert_trees_close(got["grads"][0], want["grads"][0], rtol, "params grads")
        assert_trees_close(got["grads"][1], want["grads"][1], rtol, "input grads")
        assert_trees_close(got["state"], want["state"], tolerance(dtype), "state")


def _temp(door, **options):
    built = load(door).build(DEPTH, dtype=jnp.float32, **options)
    grad = jax.grad(loss_fn(built.apply), (0, 2), has_aux=True)
    with runtime_checks(False):
        program = compiled(
            grad, built.params, built.state, built.x, jax.random.PRNGKey(1)
        )
    return temp_size(program)


@pytest.mark.parametrize("door", DOORS)
def test_the_ends_of_the_range_are_todays_programs(door):
    """All-invert compiles to the stack without a plan, all-store to the
    twin, byte for byte."""
    assert _temp(door, reversible=True, plan=PLANS["invert"]) == _temp(
        door, reversible=True
    )
    assert _temp(door, reversible=True, plan=PLANS["store"]) == _temp(
        door, reversible=False
    )


def _layer(w, state, key, h):
    h1, h2 = jnp.split(h, 2, axis=-1)
    y1 = h1 + jnp.tanh(h2 @ w[0])
    y2 = h2 + jnp.tanh(y1 @ w[1])
    return jnp.concatenate([y1, y2], -1), state + 1


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_a_list_of_layers_takes_a_plan(plan):
    """The unrolled stack splits its list as the stacked one splits its
    arrays: the same values, gradients and per-layer state."""
    k = jax.random.key(0)
    w = 0.5 * jax.random.normal(k, (DEPTH, 2, 4, 4))
    x = jax.random.normal(jax.random.key(1), (3, 8))
    state = jnp.zeros([DEPTH], jnp.int32)

    def loss(w, x, options, unrolled):
        if unrolled:
            triples = [(w[i], state[i], None) for i in range(DEPTH)]
            y, new = stack.run_stack([_layer] * DEPTH, triples, x, options)
            new = jnp.stack(new)
        else:
            y, new = stack.run_stack(_layer, (w, state, None), x, options)
        return jnp.sum(jnp.sin(y)), new

    grad = jax.value_and_grad(loss, (0, 1), has_aux=True)
    rtol = tolerance(jnp.float32, loops=True)
    want = grad(w, x, StackOptions(reversible=False), False)
    for unrolled in (False, True):
        got = grad(w, x, StackOptions(plan=PLANS[plan]), unrolled)
        assert_trees_close(got, want, rtol, f"unrolled={unrolled}")


@pytest.mark.parametrize(
    "options, error, message",
    [
        (dict(plan=(1, 2)), TypeError, r"plan must be None, a revnet.StackPlan"),
        (
            dict(plan=revnet.StackPlan(store=1), reversible=False),
            ValueError,
            r"with reversible=False every layer stores",
        ),
    ],
)
def test_a_bad_plan_is_refused_in_one_line(options, error, message):
    with pytest.raises(error, match=message) as info:
        StackOptions.checked("ReversibleSequence", **options)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(store=-1), ValueError, r"revnet.StackPlan: store must be"),
        (dict(remat=1.5), TypeError, r"revnet.StackPlan: remat must be"),
        (dict(store=True), TypeError, r"revnet.StackPlan: store must be"),
    ],
)
def test_a_bad_count_is_refused_in_one_line(kwargs, error, message):
    with pytest.raises(error, match=message):
        revnet.StackPlan(**kwargs)


def test_a_plan_longer_than_the_stack_is_refused_in_one_line():
    w = jnp.zeros((3, 2, 4, 4))
    with pytest.raises(ValueError, match=r"seq: its plan stores 2 and recomputes 2 "):
        stack.run_stack(
            _layer,
            (w, jnp.zeros([3], jnp.int32), None),
            jnp.ones((2, 8)),
            StackOptions(plan=revnet.StackPlan(store=2, remat=2)),
            name="seq",
        )


def _flow_layer(w, state, key, h):
    h1, h2 = jnp.split(h, 2, axis=-1)
    return jnp.concatenate([h2, h1 * jnp.exp(jnp.tanh(h2 @ w)) + h2], -1), state


def _nll(w, h, options):
    y, log_det, _ = stack.run_stack_with_log_det(
        _flow_layer, (w, None, None), h, options
    )
    return jnp.sum(y**2) - jnp.sum(log_det), log_det


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_a_flow_takes_a_plan(plan):
    """Log-determinants equal slogdet(jacfwd) at 1e-10 and gradients the
    twin's, in float64, whatever the plan."""
    with jax.enable_x64(True):
        w = 0.3 * jax.random.normal(jax.random.key(0), (DEPTH, 2, 2), jnp.float64)
        h = jax.random.normal(jax.random.key(1), (3, 4), jnp.float64)

        def plain(h):
            return stack.run_stack(_flow_layer, (w, None, None), h, TWIN)[0]

        want = per_example_slogdet(plain, (), h)
        grad = jax.grad(_nll, (0, 1), has_aux=True)
        got, log_det = grad(w, h, StackOptions(plan=PLANS[plan]))
        np.testing.assert_allclose(log_det, want, rtol=1e-10, atol=1e-10)
        assert_trees_close(got, grad(w, h, TWIN)[0], tolerance(jnp.float64), "grads")


def test_a_flow_planned_to_invert_compiles_to_the_flow_without_a_plan():
    w = 0.3 * jax.random.normal(jax.random.key(0), (DEPTH, 2, 2))
    h = jax.random.normal(jax.random.key(1), (64, 4))
    grad = jax.grad(_nll, (0, 1), has_aux=True)
    with runtime_checks(False):
        sizes = [
            temp_size(compiled(lambda w, h: grad(w, h, options), w, h))
            for options in (StackOptions(), StackOptions(plan=PLANS["invert"]))
        ]
    assert sizes[0] == sizes[1], sizes
