"""ReversibleSequence: dropout replay, BatchNorm state, heterogeneous stacks."""

from __future__ import annotations

import functools
import warnings

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import revnet
from revnet import blocks
from revnet._engine import Storage
from tests.doors.haiku.descriptors import additive, affine, conv_unit
from tests.helpers import (
    assert_trees_close,
    batch_block_slogdet,
    calls_of,
    tolerance,
)


def dropout_mlp(h: jax.Array) -> jax.Array:
    h = jnp.tanh(hk.Linear(16)(h))
    h = hk.dropout(hk.next_rng_key(), 0.5, h)
    return hk.Linear(4)(h)


def dropout_block(h: jax.Array) -> jax.Array:
    return blocks.AdditiveCoupling(dropout_mlp, dropout_mlp)(h)


@pytest.mark.slow
def test_dropout_is_replayed_exactly():
    def net(reversible):
        def seq():
            return blocks.ReversibleSequence(dropout_block, 4, reversible=reversible)

        return (
            hk.transform(lambda x: seq()(x)),
            hk.transform(lambda y: seq().inverse(y)),
        )

    (fwd, inv), (twin, _) = net(True), net(False)
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 8))
    params = fwd.init(jax.random.PRNGKey(0), x)
    key, other = jax.random.PRNGKey(2), jax.random.PRNGKey(3)

    def grads(model, key):
        def loss(p, x):
            return jnp.sum(jnp.sin(model.apply(p, key, x)))

        return jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)

    assert_trees_close(grads(fwd, key), grads(twin, key), tolerance(jnp.float32))
    # Dropout is active: another key gives another function.
    y, y_other = fwd.apply(params, key, x), fwd.apply(params, other, x)
    assert not np.allclose(y, y_other, atol=1e-3)  # two masks: far apart
    # The inverse replays the forward's masks when given the same key.
    tol = tolerance(jnp.float32, "round_trip")
    np.testing.assert_allclose(inv.apply(params, key, y), x, rtol=tol, atol=tol)
    assert not np.allclose(inv.apply(params, other, y), x, atol=1e-2)  # far off


def batchnorm_net(reversible):
    return hk.transform_with_state(
        lambda x, is_training: blocks.ReversibleSequence(
            conv_unit, 3, reversible=reversible
        )(x, is_training=is_training)
    )


@pytest.mark.slow
def test_batchnorm_state_updated_once_like_the_twin():
    rev, twin = batchnorm_net(True), batchnorm_net(False)
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 4, 4, 8)) * 2 + 1
    # Initialised from another batch: at init each layer sees its own input,
    # so the same batch would give a first EMA update equal to the init value.
    x_init = jax.random.normal(jax.random.PRNGKey(2), x.shape)
    init = jax.jit(rev.init, static_argnums=2)
    params, state = init(jax.random.PRNGKey(0), x_init, True)

    def step(model):
        def loss(p):
            y, new_state = model.apply(p, state, None, x, True)
            return jnp.sum(jnp.sin(y)), new_state

        return jax.jit(jax.grad(loss, has_aux=True))(params)

    (g_rev, state_rev), (g_std, state_std) = step(rev), step(twin)
    assert_trees_close(g_rev, g_std, tolerance(jnp.float32))
    assert jax.tree.structure(state_rev) == jax.tree.structure(state)
    for path, new in jax.tree_util.tree_flatten_with_path(state_rev)[0]:
        name = jax.tree_util.keystr(path)
        if "counter" in name:
            # One update per forward pass: reconstruction must not add another.
            np.testing.assert_array_equal(new, 1, err_msg=name)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(
            a,
            b,
            rtol=tolerance(jnp.float32, "values"),  # the same forward statistics
            atol=1e-7,  # float32's epsilon, for statistics near zero
        ),
        state_rev,
        state_std,
    )
    changed = jax.tree.map(lambda a, b: not np.allclose(a, b), state_rev, state)
    assert all(jax.tree.leaves(changed))


@pytest.mark.slow
def test_batchnorm_eval_mode_uses_running_statistics():
    rev, twin = batchnorm_net(True), batchnorm_net(False)
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 4, 4, 8))
    params, state = jax.jit(rev.init, static_argnums=2)(jax.random.PRNGKey(0), x, True)
    _, trained = jax.jit(rev.apply, static_argnums=4)(
        params, state, None, x * 3 + 1, True
    )
    apply = jax.jit(rev.apply, static_argnums=4)
    y, new_state = apply(params, trained, None, x, False)
    # No batch statistics: one example alone gives the same output.
    y_one, _ = apply(params, trained, None, x[:1], False)
    tol = 1e-5  # a batch of one is another XLA program: not the same roundings
    np.testing.assert_allclose(y_one, y[:1], rtol=tol, atol=tol)
    # The running statistics are used, and not changed.
    y_init, _ = apply(params, state, None, x, False)
    assert not np.allclose(y, y_init, atol=1e-3)  # far apart, not rounding
    jax.tree.map(np.testing.assert_array_equal, new_state, trained)

    def grads(model):
        def loss(p):
            return jnp.sum(jnp.sin(model.apply(p, trained, None, x, False)[0]))

        return jax.jit(jax.grad(loss))(params)

    assert_trees_close(grads(rev), grads(twin), tolerance(jnp.float32))


def norm_drop_net(u: jax.Array, is_training: bool) -> jax.Array:
    """An affine coupling's net: BatchNorm (running statistics unless
    training) and dropout, whose keys come from ``apply``'s rng."""
    u = hk.BatchNorm(True, True, 0.9)(hk.Linear(16)(u), is_training)
    return hk.Linear(8)(hk.dropout(hk.next_rng_key(), 0.5, jnp.tanh(u)))


def norm_drop_block(h: jax.Array, is_training: bool) -> jax.Array:
    return blocks.AffineCoupling(lambda u: norm_drop_net(u, is_training))(h)


@functools.cache
def state_flow(reversible):
    """``apply(params, state, rng, x, log_det)`` of a flow whose blocks hold
    BatchNorm state and dropout, in eval mode: the call, or
    ``forward_and_log_det``."""

    def run(x, log_det, is_training=False):
        seq = blocks.ReversibleSequence(norm_drop_block, 2, reversible=reversible)
        if log_det:
            return seq.forward_and_log_det(x, is_training)
        return seq(x, is_training)

    return hk.transform_with_state(run)


def state_flow_init(dtype):
    """Parameters and state (one training call: statistics that are not the
    initial ones), and an input."""
    x = jax.random.normal(jax.random.key(1), (6, 8), dtype)
    params, state = state_flow(True).init(jax.random.key(0), x, False, True)
    _, state = state_flow(True).apply(params, state, jax.random.key(2), x, False, True)
    return params, state, x


def test_log_det_with_state_not_computed_from_the_input():
    """BatchNorm with is_training=False passes its statistics through and
    dropout draws from the rng: the log-det is the map's, per example (masks
    included), against slogdet(jacfwd) of the twin's call in float64, and the
    state comes back as the call's."""
    with jax.enable_x64(True):
        params, state, x = state_flow_init(jnp.float64)
        rng = jax.random.key(3)
        (y, log_det), new = state_flow(True).apply(params, state, rng, x, True)
        called, called_state = state_flow(True).apply(params, state, rng, x, False)
        tol = tolerance(jnp.float64, "values")  # the same forward pass
        np.testing.assert_allclose(y, called, rtol=tol, atol=tol)
        jax.tree.map(np.testing.assert_array_equal, new, called_state)

        def twin(v):
            return state_flow(False).apply(params, state, rng, v, False)[0]

        ref = batch_block_slogdet(twin, x)
        assert log_det.shape == (6,)
        np.testing.assert_allclose(
            log_det,
            ref,
            rtol=tolerance(jnp.float64, "log_det"),
            atol=tolerance(jnp.float64, "log_det_floor"),
        )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=["f32", "f64"])
def test_log_det_gradients_with_state_equal_the_twin(dtype):
    with jax.enable_x64(dtype == jnp.float64):
        params, state, x = state_flow_init(dtype)
        cot = jax.random.normal(jax.random.key(4), x.shape, dtype)
        c = jax.random.normal(jax.random.key(5), (x.shape[0],), dtype)

        def grads(reversible):
            def loss(p, x):
                out = state_flow(reversible).apply(p, state, jax.random.key(3), x, True)
                y, log_det = out[0]
                return jnp.sum(y * cot) + jnp.sum(log_det * c)

            return jax.jit(jax.grad(loss, (0, 1)))(params, x)

        rev, std = grads(True), grads(False)
        assert_trees_close(rev, std, tolerance(jnp.dtype(dtype).name), "gradients")


def test_log_det_with_batch_statistics_in_training_mode_is_refused():
    params, state, x = state_flow_init(jnp.float32)
    with pytest.raises(ValueError, match="new state is computed from the input"):
        state_flow(True).apply(params, state, jax.random.key(3), x, True, True)


def test_blocks_that_lose_information_are_refused():
    """Any block the core can run backwards is accepted; others are refused."""

    def relu_after(h):
        return jax.nn.relu(additive(h))

    def half_dropped(h):
        y = additive(h)
        return jnp.concatenate([y[..., :4], jnp.zeros_like(y[..., 4:])], -1)

    x = jnp.ones([2, 8])
    for block in (relu_after, half_dropped):
        model = hk.transform(lambda x: blocks.ReversibleSequence(block, 2)(x))
        with pytest.raises(revnet.NotInvertibleError, match="reversible_sequence"):
            model.init(jax.random.PRNGKey(0), x)


def test_code_between_modules_is_inverted():
    """A block need not be a chain of revnet modules: ``tanh`` has an inverse."""

    def fn(x):
        seq = blocks.ReversibleSequence(lambda h: jnp.tanh(additive(h) / 8), 3)
        y = seq(x)
        return y, seq.inverse(y)

    model = hk.transform(fn)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 8))
    params = model.init(jax.random.PRNGKey(0), x)
    y, rebuilt = jax.jit(model.apply)(params, None, x)
    assert not np.allclose(y, x, atol=1e-2)  # far apart, not rounding
    tol = tolerance(jnp.float32, "round_trip")
    np.testing.assert_allclose(rebuilt, x, rtol=tol, atol=tol)


def test_blocks_must_preserve_shape():
    model = hk.transform(
        lambda x: blocks.ReversibleSequence(lambda h: blocks.Squeeze()(h), 2)(x)
    )
    with pytest.raises(ValueError, match="reversible_sequence.*preserve"):
        model.init(jax.random.PRNGKey(0), jnp.ones([1, 4, 4, 2]))


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"num_layers": 0}],
    ids=["missing", "zero"],
)
def test_num_layers_is_required_for_one_block_fn(kwargs):
    with pytest.raises(ValueError, match="num_layers"):
        hk.transform(lambda x: blocks.ReversibleSequence(additive, **kwargs)(x)).init(
            None, jnp.ones([1, 4])
        )


def test_array_arguments_are_rejected():
    model = hk.transform(
        lambda x: blocks.ReversibleSequence(lambda h, s: additive(h * s), 2)(
            x, jnp.ones(())
        )
    )
    with pytest.raises(TypeError, match="static"):
        model.init(jax.random.PRNGKey(0), jnp.ones([1, 4]))


@pytest.mark.parametrize(
    "config, convs", [("revnet38", 38), ("revnet110", 110), ("revnet164", 164)]
)
def test_revnet_family_depths(config, convs):
    """Depth counts the convolutions on the path through the reversible units.

    Each unit has two residual functions of two (three with bottlenecks)
    convolutions; add the initial convolution and the classifier.
    """
    net = hk.transform_with_state(lambda x: blocks.RevNet(config, 10)(x, True))
    x = jax.ShapeDtypeStruct((1, 32, 32, 3), jnp.float32)
    params, _ = jax.eval_shape(net.init, jax.random.PRNGKey(0), x)
    stage_convs = sum(
        leaf["w"].shape[0]
        for path, leaf in params.items()
        if "/stage_" in path and "conv_" in path
    )
    assert stage_convs + 2 == convs


@pytest.mark.slow
def test_sequences_nest_inside_blocks():
    """A sequence inside a block is one invertible call inside the outer one."""

    def net(reversible):
        def fn(x):
            inner = blocks.ReversibleSequence(affine, 2, reversible=reversible)
            outer = blocks.ReversibleSequence(
                lambda h: inner(additive(h)), 3, reversible=reversible
            )
            y = outer(x)
            return y, outer.inverse(y)

        return hk.transform(fn)

    x = jax.random.normal(jax.random.PRNGKey(1), (4, 8))
    params = net(True).init(jax.random.PRNGKey(0), x)
    assert {p.shape[:2] for p in jax.tree.leaves(params)} >= {(3, 2)}
    _, rebuilt = jax.jit(net(True).apply)(params, None, x)
    tol = tolerance(jnp.float32, "round_trip")
    np.testing.assert_allclose(rebuilt, x, rtol=tol, atol=tol)

    def grads(reversible):
        def loss(p, x):
            return jnp.sum(jnp.sin(net(reversible).apply(p, None, x)[0]))

        return jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)

    assert_trees_close(grads(True), grads(False), tolerance(jnp.float32))


_MODELS = {
    "sequence": (lambda **kw: blocks.ReversibleSequence(additive, 2, **kw), (2, 4)),
    "revnet": (
        lambda **kw: functools.partial(
            blocks.RevNet(blocks.RevNetConfig((2, 2), (4, 4, 8)), 3, **kw),
            is_training=True,
        ),
        (2, 4, 4, 3),
    ),
    "transformer": (
        lambda **kw: functools.partial(
            blocks.ReversibleTransformer(1, 2, 8, 8, **kw), is_training=True
        ),
        (2, 3, 8),
    ),
}


def _stacks_run(name, **options):
    """The ReversibleSequences a model runs, as a method interceptor sees them,
    and the stack options checked while it is made and run once."""
    make, shape = _MODELS[name]
    seen = []

    def intercept(next_f, args, kwargs, context):
        if isinstance(context.module, blocks.ReversibleSequence):
            seen.append(context.module)
        return next_f(*args, **kwargs)

    def fn(x):
        with hk.intercept_methods(intercept):
            return make(**options)(x)

    with calls_of(Storage.checked.__func__) as checked:
        hk.transform_with_state(fn).init(jax.random.PRNGKey(0), jnp.ones(shape))
    return {seq.module_name: seq for seq in seen}, checked


@pytest.mark.parametrize("name", list(_MODELS))
def test_models_pass_decisions_and_kinks_to_their_stacks_checked_once(name):
    stacks, checked = _stacks_run(name, decisions="recompute", kinks="store")
    assert stacks, name
    for seq in stacks.values():
        assert (seq.decisions, seq.kinks) == ("recompute", "store"), seq.module_name
    # Once per module the user made, however many stacks it builds (the other
    # callers are the public functions the stack runs, which check their own
    # arguments).
    assert checked.count("checked") == 1, checked  # StackOptions.checked


def test_revnet_kinks_are_stored_per_unit_only_when_asked():
    # RevNet's units take relu of the rebuilt half: kinks="store" keeps their
    # branches, whatever decisions= is; the defaults keep none.
    config = blocks.RevNetConfig((2,), (4, 4))
    x = jnp.ones([2, 4, 4, 3])

    def kept(**options):
        net = hk.transform_with_state(
            lambda x: blocks.RevNet(config, 3, **options)(x, True)
        )
        params, state = net.init(jax.random.PRNGKey(0), x)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", revnet.StoredGrowthWarning)
            report = revnet.stored(
                lambda p, x: net.apply(p, state, None, x)[0], params, x
            )
        return report.by_kind()

    assert "kink" not in kept()
    assert kept(kinks="store")["kink"] > 0
    assert (
        kept(kinks="store", decisions="recompute")["kink"]
        == kept(kinks="store")["kink"]
    )
    assert "kink" not in kept(decisions="recompute")
