"""The flow blocks through every front door (Haiku, Equinox, Flax NNX).

Each door (``build_flow`` in ``tests/doors/adapters/<name>.py``) builds a
Glow stack of its own ``ActNorm``, ``InvertibleConv1x1`` and
``AffineCoupling`` in a ``ReversibleSequence``, initialised from data, and
returns its ``forward_and_log_det``. Every row checks the derived
log-determinant against ``slogdet`` of the Jacobian in float64, the
reversible gradients against the non-reversible twin's on the same
parameters, the inverse, memory flat in depth, and that data-dependent
initialisation sees each layer's own input.
"""

from __future__ import annotations

import functools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import revnet
from revnet import blocks
from revnet.flows import StandardNormal
from tests.doors.adapters import layer_input
from tests.doors.test_table import DOORS, load
from tests.helpers import (
    assert_trees_close,
    compiled,
    per_example_slogdet,
    temp_size,
    tolerance,
)

RTOL = tolerance("float64", "log_det")  # against slogdet(jacfwd)
ATOL = tolerance("float64", "log_det_floor")  # for log-dets of zero


@pytest.fixture(params=DOORS)
def door(request):
    return request.param


@functools.cache
def _flow(name, dtype, reversible, depth, actnorm_only, leaky):
    return load(name).build_flow(
        depth,
        dtype=dtype,
        reversible=reversible,
        actnorm_only=actnorm_only,
        leaky=leaky,
    )


def flow(name, dtype, reversible=True, depth=3, actnorm_only=False, leaky=False):
    """The door's flow (built once); a float64 one is built and must be run
    under ``jax.enable_x64``."""
    with x64(dtype):
        return _flow(name, dtype, reversible, depth, actnorm_only, leaky)


def x64(dtype):
    return jax.enable_x64(jnp.dtype(dtype) == jnp.float64)


def nll(forward):
    """The flow's loss: ``-(log_prob(z) + log_det)``, averaged."""

    def loss(params, x):
        z, log_det = forward(params, x)
        base = StandardNormal(z.shape[1:])
        return -jnp.mean(base.log_prob(z) + log_det)

    return loss


@pytest.mark.parametrize(
    "leaky", [pytest.param(False, id="glow"), pytest.param(True, id="leaky")]
)
def test_log_det_equals_slogdet_of_the_jacobian(door, leaky):
    """``leaky``: each step ends with a leaky ReLU, a decision the plan stores
    per layer, which the per-example proof reads through the scan."""
    with jax.enable_x64(True):
        f = flow(door, jnp.float64, True, leaky=leaky)
        _, log_det = jax.jit(f.forward)(f.params, f.x)
        plain = flow(door, jnp.float64, False, leaky=leaky)
        # The reference differentiates the twin in reverse mode: the 1x1
        # convolution is a custom_ivjp function, which has no forward mode.
        ref = per_example_slogdet(
            lambda x: (plain.forward(plain.params, x)[0],), (), f.x, jac=jax.jacrev
        )
        assert log_det.shape == (f.x.shape[0],)
        np.testing.assert_allclose(log_det, ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    "dtype", [pytest.param(jnp.float32, id="f32"), pytest.param(jnp.float64, id="f64")]
)
def test_gradients_equal_the_twins(door, dtype):
    with x64(dtype):
        rev, plain = flow(door, dtype, True), flow(door, dtype, False)
        assert_trees_close(rev.params, plain.params, 0.0, "the same parameters")
        grads = [
            jax.jit(jax.value_and_grad(nll(f.forward), (0, 1)))(f.params, f.x)
            for f in (rev, plain)
        ]
        rtol = tolerance(dtype)
        assert_trees_close(grads[0][0], grads[1][0], rtol, "loss")
        assert_trees_close(grads[0][1][0], grads[1][1][0], rtol, "params")
        assert_trees_close(grads[0][1][1], grads[1][1][1], rtol, "input")


def test_log_det_gradients_equal_those_of_the_reference(door):
    with jax.enable_x64(True):
        f = flow(door, jnp.float64, True, depth=2)
        plain = flow(door, jnp.float64, False, depth=2)

        def derived(params):
            return jnp.sum(f.forward(params, f.x)[1])

        def reference(params):
            g = lambda x: (plain.forward(params, x)[0],)  # noqa: E731
            return jnp.sum(per_example_slogdet(g, (), f.x, jac=jax.jacrev))

        assert_trees_close(
            jax.jit(jax.grad(derived))(f.params),
            jax.jit(jax.grad(reference))(plain.params),
            1e-8,  # gradients of log-dets through jacrev: looser than RTOL
            "d log_det / d params",
        )


def test_inverse_rebuilds_the_input(door):
    with jax.enable_x64(True):
        f = flow(door, jnp.float64, True)
        y, _ = f.forward(f.params, f.x)
        tol = tolerance("float64", "round_trip")
        np.testing.assert_allclose(f.inverse(f.params, y), f.x, rtol=tol, atol=tol)


def test_actnorm_is_initialised_from_each_layers_own_input(door):
    # A stack of ActNorms alone: the first normalises the batch, so the later
    # ones, initialised from its output, start as the identity. Initialised
    # from the stack's input instead, they would normalise it again.
    f = flow(door, jnp.float32, True, actnorm_only=True)
    y, log_det = f.forward(f.params, f.x)
    np.testing.assert_allclose(jnp.mean(y, 0), 0.0, atol=1e-5)  # ActNorm's float32 mean
    np.testing.assert_allclose(jnp.std(y, 0), 1.0, rtol=1e-4)  # and its std
    first = -jnp.sum(jnp.log(jnp.std(f.x, 0) + 1e-6))
    np.testing.assert_allclose(log_det, first, rtol=1e-4)  # the log of that std


def test_memory_is_flat_in_depth(door):
    def temp(depth):
        f = flow(door, jnp.float32, True, depth=depth)
        grad = jax.grad(nll(f.forward))
        return temp_size(compiled(grad, f.params, f.x))

    shallow, deep = temp(4), temp(16)
    assert deep <= 1.02 * shallow, (shallow, deep)


def test_the_plain_twin_grows_in_depth(door):
    # The check above can fail: the same flow without reversibility holds
    # every layer's activations.
    def temp(depth):
        f = flow(door, jnp.float32, False, depth=depth)
        return temp_size(compiled(jax.grad(nll(f.forward)), f.params, f.x))

    assert temp(16) > 2 * temp(4)


LAYERS = ["ActNorm", "InvertibleConv1x1", "Squeeze", "ChannelPermutation"]


@pytest.mark.parametrize("layer", LAYERS)
def test_each_flow_layer_alone(door, layer):
    with jax.enable_x64(True):
        layers = load(door).flow_layers(jnp.float64)
        if layer not in layers:
            pytest.skip(f"the {door} door has no {layer}")
        forward, inverse = layers[layer]
        x = layer_input(jnp.float64)
        y, log_det = forward(x)
        ref = per_example_slogdet(lambda x: (forward(x)[0],), (), x, jac=jax.jacrev)
        assert log_det.shape == (x.shape[0],)
        np.testing.assert_allclose(log_det, ref, rtol=RTOL, atol=ATOL)
        tol = tolerance("float64", "round_trip")
        np.testing.assert_allclose(inverse(y), x, rtol=tol, atol=tol)


def test_a_sequence_with_anchors_refuses_log_dets():

    def model(x):
        seq = blocks.ReversibleSequence(
            lambda h: blocks.ActNorm()(h), 4, anchor_every=2
        )
        return seq.forward_and_log_det(x)

    with pytest.raises(ValueError, match="anchor_every or drift"):
        hk.transform(model).init(jax.random.PRNGKey(0), jnp.ones((2, 4)))


def test_a_block_with_batch_statistics_is_refused():

    def block(h):
        bn = hk.BatchNorm(True, True, 0.9)
        return blocks.AdditiveCoupling(lambda u: bn(u, True), lambda u: u)(h)

    def model(x):
        return blocks.ReversibleSequence(block, 2).forward_and_log_det(x)

    with pytest.raises(ValueError, match="new state is computed from the input"):
        hk.transform_with_state(model).init(jax.random.PRNGKey(0), jnp.ones((2, 4)))


def _mixing_sequences():
    """``forward_and_log_det`` of each door's sequence of a block whose map
    reads the batch's mean (Equinox's runs each example on its own)."""

    def mixes(h, scale=1.0):
        a, b = jnp.split(h, 2, -1)
        return jnp.concatenate([a + scale * jnp.mean(b, 0), b], -1)

    def haiku(x):
        model = hk.transform(
            lambda x: blocks.ReversibleSequence(mixes, 2).forward_and_log_det(x)
        )
        return model.init(jax.random.PRNGKey(0), x)

    yield pytest.param(haiku, id="haiku")
    try:
        from flax import nnx

        import revnet.nnx as rnnx
    except ImportError:
        return

    class Mixes(nnx.Module):
        def __init__(self, *, rngs):
            self.scale = nnx.Param(jnp.ones(()))

        def __call__(self, h):
            return mixes(h, self.scale[...])

    def flax(x):
        return rnnx.ReversibleSequence(Mixes, 2, rngs=nnx.Rngs(0)).forward_and_log_det(
            x
        )

    yield pytest.param(flax, id="nnx")


@pytest.mark.parametrize("run", _mixing_sequences())
def test_a_block_that_mixes_examples_is_refused_in_the_doors_words(run):
    """The door's method takes no ``batch_ndim``: its one-line refusal says
    what to change in the blocks instead of asking for one."""
    with pytest.raises(revnet.NotInvertibleError) as refused:
        run(jnp.ones((2, 4)))
    message = str(refused.value)
    assert "mixes the batch's examples" in message, message
    assert "blocks must map each example on its own" in message, message
    assert "batch_ndim" not in message and "\n" not in message, message


def test_a_step_without_a_log_det_is_named():
    @revnet.custom_ivjp
    def double(x):
        return 2.0 * x

    double.definverse(lambda y: y / 2.0)

    def model(x):
        return blocks.ReversibleSequence(double, 2).forward_and_log_det(x)

    with pytest.raises(revnet.NotInvertibleError, match="double.*deflogdet"):
        hk.transform(model).init(jax.random.PRNGKey(0), jnp.ones((2, 4)))


def test_a_list_of_blocks_is_initialised_block_by_block():
    """NNX's and Equinox's ``initialize`` on a list of different blocks (and
    Haiku's init): each ActNorm sees its own input."""
    x = 3.0 + 2.0 * jax.random.normal(jax.random.key(0), (64, 4))
    outs = []
    pytest.importorskip("flax")
    from flax import nnx

    import revnet.nnx as rnnx

    norm = lambda rngs: rnnx.ActNorm(4)  # noqa: E731
    seq = rnnx.ReversibleSequence([norm, norm], rngs=nnx.Rngs(0))
    seq.initialize(x)
    outs.append(seq(x))
    pytest.importorskip("equinox")
    import revnet.eqx as reqx

    make = lambda key: reqx.ActNorm(4)  # noqa: E731
    seq = reqx.ReversibleSequence([make, make], key=jax.random.key(0))
    outs.append(seq.initialize(x)(x))
    norm = lambda h: blocks.ActNorm()(h)  # noqa: E731
    model = hk.transform(lambda x: blocks.ReversibleSequence([norm, norm])(x))
    outs.append(model.apply(model.init(jax.random.key(0), x), None, x))
    for y in outs:
        np.testing.assert_allclose(jnp.mean(y, 0), 0.0, atol=1e-5)  # ActNorm's mean
        np.testing.assert_allclose(jnp.std(y, 0), 1.0, rtol=1e-4)  # and its std
