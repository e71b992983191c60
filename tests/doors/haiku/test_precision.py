"""Mixed precision: residual functions in bfloat16, residual stream in float32."""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revnet import blocks
from tests.doors.haiku.descriptors import mlp
from tests.helpers import assert_trees_close, tolerance


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
    tol = tolerance(jnp.float32, "round_trip")
    np.testing.assert_allclose(rebuilt, x, rtol=tol, atol=tol)


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
    # the gradients agree with the same-policy twin to float32 accuracy. Not a
    # guarantee: a rebuilt input within float32 rounding of a bfloat16 rounding
    # boundary rounds the other way and moves a gradient entry by one bfloat16
    # step (seen at depth 16 with growing outputs); these inputs have none.
    assert_trees_close(g_rev, g_std, tolerance(jnp.float32))


# ReversibleSequence(compute_dtype=...): the couplings of its block compute in
# that dtype unless they set their own; the stream keeps its dtype.


def sequence_net(compute_dtype, reversible=True, coupling_dtype=None):
    def block(h):
        half = h.shape[-1] // 2
        return blocks.AdditiveCoupling(
            mlp([32, half]), mlp([32, half]), compute_dtype=coupling_dtype
        )(h)

    def fn(x):
        seq = blocks.ReversibleSequence(
            block, 4, reversible=reversible, compute_dtype=compute_dtype
        )
        y = seq(x)
        return y, seq.inverse(y)

    return hk.transform(fn)


def test_sequence_compute_dtype_is_its_couplings_compute_dtype():
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 16))
    params = sequence_net(jnp.bfloat16).init(jax.random.PRNGKey(0), x)
    y, rebuilt = sequence_net(jnp.bfloat16).apply(params, None, x)
    # The same program as couplings that name the dtype themselves...
    y_own, _ = sequence_net(None, coupling_dtype=jnp.bfloat16).apply(params, None, x)
    np.testing.assert_array_equal(y, y_own)
    # ...which really computed in bfloat16, while the stream stayed float32.
    y32, _ = sequence_net(None).apply(params, None, x)
    assert y.dtype == rebuilt.dtype == jnp.float32
    assert float(jnp.max(jnp.abs(y - y32))) > 1e-4
    tol = tolerance(jnp.float32, "round_trip")
    np.testing.assert_allclose(rebuilt, x, rtol=tol, atol=tol)
    # A coupling's own compute_dtype wins over the sequence's.
    y_f32, _ = sequence_net(jnp.bfloat16, coupling_dtype=jnp.float32).apply(
        params, None, x
    )
    np.testing.assert_array_equal(y_f32, y32)


@pytest.mark.parametrize(
    "stream, compute", [(jnp.float32, jnp.bfloat16), (jnp.float64, jnp.float32)]
)
def test_sequence_compute_dtype_gradients_match_same_policy_twin(stream, compute):
    with jax.enable_x64(stream == jnp.float64):
        x = jax.random.normal(jax.random.PRNGKey(1), (4, 16), stream)
        params = sequence_net(compute).init(jax.random.PRNGKey(0), x)
        params = jax.tree.map(lambda p: p.astype(stream), params)

        def grads(reversible):
            apply = sequence_net(compute, reversible).apply

            def loss(p, x):
                return jnp.sum(jnp.sin(apply(p, None, x)[0]))

            return jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)

        g_rev, g_std = grads(True), grads(False)
        leaves = jax.tree.leaves(g_rev)
        assert {g.dtype for g in leaves} == {jnp.dtype(stream)}
        assert len(leaves) == 9, "4 linear layers (w, b) per coupling, and x"
        # The rebuilt inputs round to the same compute-dtype values as the
        # forward pass's (see the test above for when they need not), so the
        # gradients agree to the stream dtype's accuracy.
        assert_trees_close(g_rev, g_std, tolerance(stream))


def test_sequence_compute_dtype_without_a_coupling_is_refused():
    def block(h):
        h1, h2 = jnp.split(h, 2, axis=-1)
        y1 = h1 + mlp([8, h2.shape[-1]])(h2)
        return jnp.concatenate([y1, h2], axis=-1)

    net = hk.transform(
        lambda x: blocks.ReversibleSequence(block, 2, compute_dtype=jnp.bfloat16)(x)
    )
    with pytest.raises(ValueError, match="build none; cast inside your own"):
        net.init(jax.random.PRNGKey(0), jnp.ones([2, 8]))
    bad = hk.transform(
        lambda x: blocks.ReversibleSequence(block, 2, compute_dtype=jnp.int32)(x)
    )
    with pytest.raises(TypeError, match="compute_dtype"):
        bad.init(jax.random.PRNGKey(0), jnp.ones([2, 8]))
