"""Coupling specifics: log-determinants, bounded scales, deep round trips."""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from revnet import blocks
from tests.blocks.descriptors import additive, mlp


def test_affine_log_det_matches_jacobian():
    model = hk.transform(
        lambda x: blocks.AffineCoupling(
            mlp([16, 6]), scale_bound=1.5
        ).forward_and_log_det(x)
    )
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 6))
    params = model.init(jax.random.PRNGKey(0), x)
    # Large output weights make the log-scales hit the soft bound.
    params = jax.tree.map(lambda p: 4 * p, params)
    _, log_det = model.apply(params, None, x)
    for i in range(x.shape[0]):
        single = lambda v: model.apply(params, None, v[None])[0][0]  # noqa: E731
        sign, expected = jnp.linalg.slogdet(jax.jacfwd(single)(x[i]))
        assert sign > 0
        np.testing.assert_allclose(log_det[i], expected, rtol=1e-5, atol=1e-5)


@settings(max_examples=6)
@given(bound=st.floats(0.1, 3.0), magnitude=st.floats(0.0, 100.0))
def test_affine_log_scale_is_softly_bounded(bound, magnitude):
    def net(h):
        raw = jnp.full(h.shape, magnitude)
        return jnp.concatenate([raw, jnp.zeros_like(h)], axis=-1)

    model = hk.transform(
        lambda x: blocks.AffineCoupling(net, scale_bound=bound).forward_and_log_det(x)
    )
    x = jnp.ones([1, 4])
    _, log_det = model.apply({}, None, x)
    per_channel = log_det[0] / 2
    assert 0 <= per_channel <= bound
    expected = bound * np.tanh(magnitude / bound)
    np.testing.assert_allclose(per_channel, expected, rtol=1e-5, atol=1e-6)


@settings(max_examples=3)
@given(
    depth=st.integers(1, 40),
    batch=st.integers(1, 4),
    half=st.sampled_from([1, 3, 8]),
    seed=st.integers(0, 2**16),
)
def test_deep_additive_round_trip(depth, batch, half, seed):
    def fwd(x):
        seq = blocks.ReversibleSequence(additive, depth)
        y = seq(x)
        return y, seq.inverse(y)

    model = hk.transform(fwd)
    x = jax.random.normal(jax.random.PRNGKey(seed), (batch, 2 * half))
    params = model.init(jax.random.PRNGKey(seed + 1), x)
    y, rebuilt = jax.jit(model.apply)(params, None, x)
    np.testing.assert_allclose(rebuilt, x, rtol=1e-4, atol=1e-4)
    assert depth == 0 or not np.allclose(y, x)


def affine_round_trip_error(depth: int, scale_bound: float | None) -> float:
    def fwd(x):
        def coupling(h):
            net = mlp([16, h.shape[-1]])
            h = blocks.AffineCoupling(net, scale_bound=scale_bound)(h)
            return blocks.ChannelPermutation()(h)

        seq = blocks.ReversibleSequence(coupling, depth)
        y = seq(x)
        return y, seq.inverse(y)

    model = hk.transform(fwd)
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 8))
    params = model.init(jax.random.PRNGKey(0), x)
    y, rebuilt = jax.jit(model.apply)(params, None, x)
    assert np.all(np.isfinite(y))
    return float(jnp.max(jnp.abs(rebuilt - x)))


def test_affine_stack_inverts_in_float32():
    """32 permuted affine couplings at initialisation invert to 1e-3."""
    bounded = affine_round_trip_error(32, 2.0)
    assert bounded <= 1e-3


def test_coupling_parameters_are_named_by_role():
    model = hk.transform(lambda x: blocks.AdditiveCoupling(mlp([4, 2]), mlp([4, 2]))(x))
    params = model.init(jax.random.PRNGKey(0), jnp.ones([1, 4]))
    assert sorted(params) == [
        "additive_coupling/~/f/mlp/~/linear_0",
        "additive_coupling/~/f/mlp/~/linear_1",
        "additive_coupling/~/g/mlp/~/linear_0",
        "additive_coupling/~/g/mlp/~/linear_1",
    ]


def test_coupling_can_be_called_twice():
    """Weight sharing: a coupling applied twice, then inverted twice."""

    def fwd(x):
        coupling = blocks.AdditiveCoupling(mlp([8, 2]), mlp([8, 2]))
        y = coupling(coupling(x))
        return y, coupling.inverse(coupling.inverse(y))

    model = hk.transform(fwd)
    x = jax.random.normal(jax.random.PRNGKey(1), (3, 4))
    params = model.init(jax.random.PRNGKey(0), x)
    assert len(params) == 4
    y, rebuilt = model.apply(params, None, x)
    np.testing.assert_allclose(rebuilt, x, rtol=1e-5, atol=1e-5)
