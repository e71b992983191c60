"""A user's own Haiku blocks in ReversibleSequence, inverted by the core.

The blocks below are written as a new user would write them: plain ``jnp`` and
ordinary Haiku modules, no revnet module in sight. Each must train with the
same gradients as its ``reversible=False`` twin on the same parameters, in
float32 and float64, with activation memory that does not grow with depth.
"""

from __future__ import annotations

import functools
import inspect
import os

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import revnet
from revnet import blocks
from tests.helpers import assert_trees_close, cast_floats, temp_bytes, tolerance


def additive_block(h):
    h1, h2 = jnp.split(h, 2, axis=-1)
    y1 = h1 + hk.nets.MLP([32, h2.shape[-1]])(h2)
    y2 = h2 + jnp.tanh(hk.Linear(h1.shape[-1])(y1))
    return jnp.concatenate([y1, y2], -1)


def affine_block(h):
    h1, h2 = jnp.split(h, 2, axis=-1)
    s = hk.Linear(h2.shape[-1], name="s")(h1)
    t = hk.Linear(h2.shape[-1], name="t")(h1)
    # The halves swap places, so that every channel is transformed in turn.
    return jnp.concatenate([h2 * jnp.exp(jnp.tanh(s)) + t, h1], -1)


def residual(u, is_training):
    u = hk.Linear(u.shape[-1])(u)
    u = jnp.tanh(hk.BatchNorm(True, True, 0.9)(u, is_training))
    return hk.dropout(hk.next_rng_key(), 0.25, u) if is_training else u


def batchnorm_dropout_block(h, is_training):
    h1, h2 = jnp.split(h, 2, axis=-1)
    y1 = h1 + residual(h2, is_training)
    return jnp.concatenate([y1, h2 + residual(y1, is_training)], -1)


BLOCKS = {
    "additive": additive_block,
    "affine": affine_block,
    "batchnorm_dropout": batchnorm_dropout_block,
}
TRAINING = {"batchnorm_dropout"}  # called with is_training=True and a key


def net(name: str, depth: int, reversible: bool):
    extra = {"is_training": True} if name in TRAINING else {}

    def fn(x):
        seq = blocks.ReversibleSequence(BLOCKS[name], depth, reversible=reversible)
        return seq(x, **extra)

    return hk.transform_with_state(fn)


def inverse_net(name: str, depth: int):
    extra = {"is_training": True} if name in TRAINING else {}
    return hk.transform_with_state(
        lambda y: blocks.ReversibleSequence(BLOCKS[name], depth).inverse(y, **extra)
    )


RNG = jax.random.PRNGKey(7)


@functools.cache
def setup(name: str, depth: int = 4):
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 16)) * 2 + 0.5
    params, state = jax.jit(net(name, depth, True).init)(jax.random.PRNGKey(0), x)
    return x, params, state


def step(name: str, reversible: bool, params, state, x):
    """Gradients of a loss for the parameters and the input, and the new state."""
    apply = net(name, 4, reversible).apply

    def loss(params, x):
        y, new_state = apply(params, state, RNG, x)
        return jnp.sum(jnp.sin(y)), new_state

    return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(params, x)


@pytest.mark.parametrize("name", sorted(BLOCKS))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.slow
def test_gradients_equal_the_twin(name, dtype):
    inputs = setup(name)  # in float32, outside the float64 context
    with jax.enable_x64(dtype == "float64"):
        x, params, state = cast_floats(inputs, jnp.dtype(dtype))
        rtol = tolerance(dtype)
        (g_rev, state_rev), (g_std, state_std) = (
            step(name, r, params, state, x) for r in (True, False)
        )
        assert {g.dtype for g in jax.tree.leaves(g_rev)} == {jnp.dtype(dtype)}
        # Every parameter leaf and the input, elementwise.
        assert len(jax.tree.leaves(g_rev[0])) == len(jax.tree.leaves(params)) > 0
        assert_trees_close(g_rev, g_std, rtol, "gradient")
        if state:
            assert_trees_close(state_rev, state_std, rtol, "state")


def test_batchnorm_state_is_updated_once_like_the_twin():
    x, params, state = setup("batchnorm_dropout")
    (_, state_rev), (_, state_std) = (
        step("batchnorm_dropout", r, params, state, x) for r in (True, False)
    )
    assert jax.tree.structure(state_rev) == jax.tree.structure(state)
    for path, new in jax.tree_util.tree_flatten_with_path(state_rev)[0]:
        name = jax.tree_util.keystr(path)
        if "counter" in name:
            # One update per forward pass: reconstruction must not add another.
            np.testing.assert_array_equal(new, 1, err_msg=name)
    rtol = tolerance(jnp.float32, "values")  # the same forward statistics
    assert_trees_close(state_rev, state_std, rtol, "state")
    changed = jax.tree.map(lambda a, b: not np.allclose(a, b), state_rev, state)
    assert all(jax.tree.leaves(changed))


def test_dropout_is_active_and_replayed_by_the_inverse():
    x, params, state = setup("batchnorm_dropout")
    apply = jax.jit(net("batchnorm_dropout", 4, True).apply)
    y, _ = apply(params, state, RNG, x)
    y_other, _ = apply(params, state, jax.random.PRNGKey(8), x)
    assert not np.allclose(y, y_other, atol=1e-3)  # two masks: far apart
    inverse = jax.jit(inverse_net("batchnorm_dropout", 4).apply)
    # BatchNorm in training mode normalises each residual function's input by
    # its own batch statistics, and the inverse rebuilds those inputs exactly
    # before it evaluates them, so the round trip is exact given the same key.
    rebuilt, _ = inverse(params, state, RNG, y)
    tol = tolerance(jnp.float32, "round_trip")
    np.testing.assert_allclose(rebuilt, x, rtol=tol, atol=tol)
    wrong, _ = inverse(params, state, jax.random.PRNGKey(8), y)
    assert not np.allclose(wrong, x, atol=1e-2)  # far off, not rounding


@pytest.mark.optimized
@pytest.mark.parametrize("name", ["additive", "affine"])
def test_inverse_round_trip(name):
    x, params, state = setup(name)
    y, _ = jax.jit(net(name, 4, True).apply)(params, state, None, x)
    rebuilt, _ = jax.jit(inverse_net(name, 4).apply)(params, state, None, y)
    assert not np.allclose(y, x, atol=1e-2)  # far apart, not rounding
    tol = tolerance(jnp.float32, "round_trip")
    np.testing.assert_allclose(rebuilt, x, rtol=tol, atol=tol)


def train_step_temp(name: str, depth: int, reversible: bool) -> int:
    model = net(name, depth, reversible)
    x = jax.ShapeDtypeStruct((256, 64), jnp.float32)
    params, state = jax.eval_shape(model.init, jax.random.PRNGKey(0), x)

    def loss(params, state, x):
        return jnp.sum(jnp.sin(model.apply(params, state, RNG, x)[0]))

    return temp_bytes(jax.grad(loss), params, state, x)


@pytest.mark.parametrize("name", sorted(BLOCKS))
@pytest.mark.slow
def test_activation_memory_is_flat_in_depth(name):
    rev = {d: train_step_temp(name, d, True) for d in (4, 32)}
    std = train_step_temp(name, 32, False)
    print(f"{name}: reversible {rev}, standard at depth 32 {std}")
    assert rev[32] <= 1.10 * rev[4]
    assert 4 * rev[32] <= std


def relu_block(h):
    return jax.nn.relu(hk.Linear(h.shape[-1])(h))


def refusals(block):
    """The errors of init and of the inverse of a sequence of ``block``."""
    x = jnp.ones([2, 4])
    for fn in (
        lambda x: blocks.ReversibleSequence(block, 2)(x),
        lambda y: blocks.ReversibleSequence(block, 2).inverse(y),
    ):
        with pytest.raises(revnet.NotInvertibleError) as info:
            hk.transform(fn).init(jax.random.PRNGKey(0), x)
        yield str(info.value)


def test_non_invertible_block_is_refused():
    for message in refusals(relu_block):
        assert message.startswith("reversible_sequence is not invertible"), message
        assert "`max`" in message and "no inverse rule" in message, message


def test_non_invertible_block_names_the_users_line():
    lines, first = inspect.getsourcelines(relu_block)
    line = first + next(i for i, text in enumerate(lines) if "relu(" in text)
    where = f"{os.path.abspath(__file__)}:{line}"
    for message in refusals(relu_block):
        assert where in message, message
