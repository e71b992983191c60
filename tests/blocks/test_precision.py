"""Mixed precision: residual functions in bfloat16, residual stream in float32."""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revnet import blocks
from tests.blocks.descriptors import mlp
from tests.blocks.helpers import assert_trees_close


def coupling_stack(compute_dtype, reversible=True):
    def block(h):
        half = h.shape[-1] // 2
        return blocks.AdditiveCoupling(
            mlp([32, half]), mlp([32, half]), compute_dtype=compute_dtype
        )(h)

    return blocks.ReversibleSequence(block, 16, reversible=reversible)


def transformer(compute_dtype, reversible=True):
    return blocks.ReversibleTransformer(
        4, 2, 16, 32, compute_dtype=compute_dtype, reversible=reversible
    )


SHAPES = {coupling_stack: (4, 16), transformer: (2, 5, 16)}


def net(make, compute_dtype, reversible=True):
    """``x -> (y, inverse(y))`` for a module built by ``make``."""
    extra = (True,) if make is transformer else ()

    def fn(x):
        module = make(compute_dtype, reversible)
        y = module(x, *extra)
        return y, module.inverse(y, *extra)

    return hk.transform(fn)


def setup(make):
    x = jax.random.normal(jax.random.PRNGKey(1), SHAPES[make])
    params = jax.jit(net(make, jnp.bfloat16).init)(jax.random.PRNGKey(0), x)
    return x, params


@pytest.mark.parametrize("make", [coupling_stack, transformer])
@pytest.mark.slow
def test_bfloat16_compute_float32_stream(make):
    x, params = setup(make)
    assert {p.dtype for p in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    y, rebuilt = jax.jit(net(make, jnp.bfloat16).apply)(params, None, x)
    assert y.dtype == rebuilt.dtype == jnp.float32
    # The residual functions really ran in bfloat16...
    y32, _ = jax.jit(net(make, None).apply)(params, None, x)
    error = float(jnp.max(jnp.abs(y - y32)))
    assert 1e-4 < error < 0.1 * float(jnp.max(jnp.abs(y32)))
    # ...while the float32 stream keeps reconstruction at float32 accuracy.
    np.testing.assert_allclose(rebuilt, x, rtol=1e-5, atol=1e-5)


def test_bfloat16_gradients_match_same_policy_twin():
    x, params = setup(coupling_stack)

    def grads(reversible):
        apply = net(coupling_stack, jnp.bfloat16, reversible).apply

        def loss(p, x):
            return jnp.sum(jnp.sin(apply(p, None, x)[0]))

        return jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)

    g_rev, g_std = grads(True), grads(False)
    assert {g.dtype for g in jax.tree.leaves(g_rev)} == {jnp.dtype(jnp.float32)}
    # Reconstruction feeds the bfloat16 functions the same rounded inputs, so
    # the gradients agree with the same-policy twin to float32 accuracy.
    assert_trees_close(g_rev, g_std, 1e-5)
