"""The framework-free stack and coupling arithmetic under every front door.

The front doors' own tests (tests/doors/haiku, nnx, equinox and the one
cross-door table in tests/doors/test_table.py) cover them through a
framework; these check what they promise on their own.
"""

from __future__ import annotations

import doctest

import jax
import jax.numpy as jnp
import pytest

from revnet._layers import couplings, stack
from revnet._layers.options import StackOptions
from tests.helpers import assert_trees_close, tolerance


@pytest.mark.parametrize("module", [stack, couplings])
def test_docstring_examples(module):
    result = doctest.testmod(
        module, extraglobs={"jax": jax, "jnp": jnp}, optionflags=doctest.ELLIPSIS
    )
    assert result.attempted > 0
    assert result.failed == 0


def _layer(w, state, key, h):
    # An additive coupling with a counter as state and a dropout-like mask.
    h1, h2 = jnp.split(h, 2, axis=-1)
    mask = 1.0 if key is None else jax.random.bernoulli(key, 0.9, h2.shape)
    y1 = h1 + jnp.tanh(h2 @ w[0]) * mask
    y2 = h2 + jnp.tanh(y1 @ w[1])
    return jnp.concatenate([y1, y2], -1), state + 1


@pytest.mark.parametrize(
    "anchor_every", [None, pytest.param(2, marks=pytest.mark.slow)]
)
def test_gradients_and_state_equal_the_plain_scan(anchor_every):
    depth, k = 5, jax.random.key(0)
    w = 0.5 * jax.random.normal(k, (depth, 2, 4, 4))
    per_layer = (w, jnp.zeros([depth], jnp.int32), jax.random.split(k, depth))
    x = jax.random.normal(jax.random.key(1), (3, 8))

    def loss(w, x, reversible):
        options = StackOptions(reversible=reversible, anchor_every=anchor_every)
        y, state = stack.run_stack(_layer, (w, *per_layer[1:]), x, options)
        return jnp.sum(jnp.sin(y)), state

    (rev, rev_state), rev_grads = jax.value_and_grad(loss, (0, 1), has_aux=True)(
        w, x, True
    )
    (std, std_state), std_grads = jax.value_and_grad(loss, (0, 1), has_aux=True)(
        w, x, False
    )
    rtol = tolerance(jnp.float32, loops=True)
    assert_trees_close(rev, std, rtol, "loss")
    assert_trees_close(rev_grads, std_grads, rtol, "grads")
    assert (rev_state == 1).all() and (std_state == 1).all()
    y, _ = stack.run_stack(_layer, per_layer, x)
    assert_trees_close(stack.invert_stack(_layer, per_layer, y), x, rtol, "x")


def test_a_list_of_layers_runs_unrolled():
    k = jax.random.key(0)
    ws = [0.5 * jax.random.normal(jax.random.fold_in(k, i), (2, 4, 4)) for i in (0, 1)]
    triples = [(w, jnp.int32(0), None) for w in ws]
    x = jax.random.normal(k, (3, 8))
    y, states = stack.run_stack([_layer, _layer], triples, x)
    stacked = (jnp.stack(ws), jnp.zeros([2], jnp.int32), None)
    want = stack.run_stack(_layer, stacked, x)[0]  # the same operations, stacked
    assert_trees_close(y, want, tolerance(jnp.float32, "values"), "y")
    assert [int(s) for s in states] == [1, 1]
    with pytest.raises(ValueError, match="a list of layers is unrolled"):
        stack.run_stack([_layer, _layer], triples, x, StackOptions(anchor_every=1))
    with pytest.raises(ValueError, match="one .params, state, key. triple per"):
        stack.run_stack([_layer, _layer], triples[:1], x)


def test_a_layer_that_changes_the_shape_is_named():
    def widen(w, state, key, h):
        return jnp.concatenate([h, h], -1), state

    with pytest.raises(ValueError, match="^mine: each block must preserve"):
        stack.run_stack(
            widen, (jnp.ones([2]), None, None), jnp.ones([3, 4]), name="mine"
        )


def test_couplings_check_their_stream_and_residuals():
    f = lambda h: (jnp.tanh(h), None)  # noqa: E731
    with pytest.raises(ValueError, match="^c: the last axis is split"):
        couplings.additive(f, f, jnp.ones([2, 3]), name="c")
    with pytest.raises(ValueError, match="expected an input of shape"):
        couplings.additive(f, f, jnp.ones([4]), name="c")
    (y, log_det), _ = couplings.affine(
        lambda h: (jnp.zeros([4]), None), jnp.ones([4]), batch_dims=0
    )
    assert log_det.shape == () and float(log_det) == 0.0
    with pytest.raises(ValueError, match="^c: net must return an array of shape"):
        couplings.affine(f, jnp.ones([2, 4]), name="c")
