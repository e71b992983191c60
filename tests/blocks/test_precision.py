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


@pytest.mark.parametrize("make", [coupling_stack, transformer])
def test_bfloat16_compute_float32_stream(make):
    def call(module, x):
        return (
            module(x, True)
            if isinstance(module, blocks.ReversibleTransformer)
            else module(x)
        )

    def inverse(module, y):
        if isinstance(module, blocks.ReversibleTransformer):
            return module.inverse(y, True)
        return module.inverse(y)

    def net(compute_dtype, reversible=True):
        def fn(x):
            module = make(compute_dtype, reversible)
            y = call(module, x)
            return y, inverse(module, y)

        return hk.transform(fn)

    shape = (4, 16) if make is coupling_stack else (2, 5, 16)
    x = jax.random.normal(jax.random.PRNGKey(1), shape)
    params = jax.jit(net(jnp.bfloat16).init)(jax.random.PRNGKey(0), x)
    assert {p.dtype for p in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}

    y, rebuilt = jax.jit(net(jnp.bfloat16).apply)(params, None, x)
    assert y.dtype == rebuilt.dtype == jnp.float32
    # The residual functions really ran in bfloat16...
    y32, _ = jax.jit(net(None).apply)(params, None, x)
    error = float(jnp.max(jnp.abs(y - y32)))
    assert 1e-4 < error < 0.1 * float(jnp.max(jnp.abs(y32)))
    # ...while the float32 stream keeps reconstruction at float32 accuracy.
    np.testing.assert_allclose(rebuilt, x, rtol=1e-5, atol=1e-5)

    def grads(reversible):
        def loss(p, x):
            return jnp.sum(jnp.sin(net(jnp.bfloat16, reversible).apply(p, None, x)[0]))

        return jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)

    g_rev, g_std = grads(True), grads(False)
    assert {g.dtype for g in jax.tree.leaves(g_rev)} == {jnp.dtype(jnp.float32)}
    # Reconstruction feeds bfloat16 functions the same rounded inputs, so the
    # gradients agree with the same-policy twin to float32 accuracy.
    assert_trees_close(g_rev, g_std, 1e-5)
