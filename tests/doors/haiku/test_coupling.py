"""Coupling specifics: log-determinants, bounded scales, deep round trips."""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import revnet
from revnet import blocks
from tests.doors.haiku.descriptors import additive, mlp
from tests.helpers import tolerance

SCALES = [{}, {"scale": "tanh", "scale_bound": 1.5}, {"scale": "exp"}]


# (dtype, rtol, atol): the hand-written log-det against the derived one and
# against slogdet(jacfwd).
PRECISIONS = {
    "f32": (
        jnp.float32,
        tolerance(jnp.float32, "log_det"),
        1e-5,  # slogdet of a float32 jacobian: looser than "log_det_floor"
    ),
    "f64": (
        jnp.float64,
        tolerance(jnp.float64, "log_det"),
        tolerance(jnp.float64, "log_det_floor"),
    ),
}


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("scale", SCALES, ids=["sigmoid", "tanh", "exp"])
def test_affine_log_det_matches_jacobian(scale, precision):
    dtype, rtol, atol = PRECISIONS[precision]
    model = hk.transform(
        lambda x: blocks.AffineCoupling(
            mlp([16, 6]), zero_init=False, **scale
        ).forward_and_log_det(x)
    )
    with jax.enable_x64(dtype == jnp.float64):
        x = jax.random.normal(jax.random.PRNGKey(1), (2, 6), dtype)
        params = model.init(jax.random.PRNGKey(0), x)
        # Large output weights make the scales reach their bounds.
        params = jax.tree.map(lambda p: (4 if scale else 8) * p, params)
        _, log_det = model.apply(params, None, x)
        assert log_det.dtype == dtype
        # The hand-written log-det is the one revnet derives from the program.
        _, derived = revnet.forward_and_log_det(
            lambda p, v: model.apply(p, None, v)[0],
            params,
            x,
            known_argnums=0,
            batch_ndim=1,
        )
        np.testing.assert_allclose(log_det, derived, rtol=rtol, atol=atol)
        for i in range(x.shape[0]):
            single = lambda v: model.apply(params, None, v[None])[0][0]  # noqa: E731
            sign, expected = jnp.linalg.slogdet(jax.jacfwd(single)(x[i]))
            assert sign > 0
            np.testing.assert_allclose(log_det[i], expected, rtol=rtol, atol=atol)


@settings(max_examples=6)
@given(bound=st.floats(0.1, 3.0), magnitude=st.floats(0.0, 100.0))
def test_affine_log_scale_is_softly_bounded(bound, magnitude):
    def net(h):
        raw = jnp.full(h.shape, magnitude)
        return jnp.concatenate([raw, jnp.zeros_like(h)], axis=-1)

    model = hk.transform(
        lambda x: blocks.AffineCoupling(
            net, scale="tanh", scale_bound=bound
        ).forward_and_log_det(x)
    )
    x = jnp.ones([1, 4])
    _, log_det = model.apply({}, None, x)
    per_channel = log_det[0] / 2
    assert 0 <= per_channel <= bound
    expected = bound * np.tanh(magnitude / bound)
    np.testing.assert_allclose(
        per_channel,
        expected,
        rtol=tolerance("float32", "log_det"),
        atol=tolerance("float32", "log_det_floor"),
    )


@settings(max_examples=6)
@given(magnitude=st.floats(-100.0, 100.0))
def test_affine_default_scale_stays_between_half_and_three_halves(magnitude):
    def net(h):
        raw = jnp.full(h.shape, magnitude)
        return jnp.concatenate([raw, jnp.zeros_like(h)], axis=-1)

    model = hk.transform(lambda x: blocks.AffineCoupling(net)(x))
    x = jnp.ones([1, 4])
    y = model.apply({}, None, x)
    scale = y[0, 2:]  # x2 = 1 and shift 0: y2 is the scale itself
    want = 0.5 + 1 / (1 + np.exp(-magnitude))  # a closed form
    np.testing.assert_allclose(scale, want, rtol=tolerance("float32", "values"))
    assert np.all((0.5 <= scale) & (scale <= 1.5))


def test_affine_zero_init_starts_at_the_identity():
    def make(**kw):
        return hk.transform(lambda x: blocks.AffineCoupling(mlp([8, 4]), **kw)(x))

    x = jax.random.normal(jax.random.PRNGKey(1), (3, 4))
    params = make().init(jax.random.PRNGKey(0), x)
    # The output layer (created last) is zero; the hidden layer is not.
    out, hidden = (
        "affine_coupling/~/net/mlp/~/linear_1",
        "affine_coupling/~/net/mlp/~/linear_0",
    )
    assert all(not np.any(v) for v in params[out].values())
    assert np.any(params[hidden]["w"])
    np.testing.assert_array_equal(make().apply(params, None, x), x)
    random = make(zero_init=False).init(jax.random.PRNGKey(0), x)
    np.testing.assert_array_equal(random[hidden]["w"], params[hidden]["w"])
    assert np.any(random[out]["w"])
    assert not np.allclose(make().apply(random, None, x), x)


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
    np.testing.assert_allclose(rebuilt, x, rtol=1e-4, atol=1e-4)  # up to 40 layers
    assert depth == 0 or not np.allclose(y, x)


def affine_round_trip_error(depth: int, **scale) -> float:
    def fwd(x):
        def coupling(h):
            net = mlp([16, h.shape[-1]])
            h = blocks.AffineCoupling(net, zero_init=False, **scale)(h)
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
    bound = 1e-3  # the docstring's: 32 float32 affine layers, not "round_trip"
    assert affine_round_trip_error(32, scale="tanh", scale_bound=2.0) <= bound
    assert affine_round_trip_error(32) <= bound


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
    tol = tolerance("float32", "round_trip")
    np.testing.assert_allclose(rebuilt, x, rtol=tol, atol=tol)
