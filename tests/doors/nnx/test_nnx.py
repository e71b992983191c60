"""The Flax NNX front door: revnet.nnx against its non-reversible twin."""

from __future__ import annotations

import doctest
import functools
import importlib
import importlib.util
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import (
    ROOT,
    assert_trees_close,
    batch_block_slogdet,
    cast_floats,
    load_example,
    tolerance,
)

pytest.importorskip("flax", reason="revnet.nnx needs flax: pip install '.[nnx]'")
optax = pytest.importorskip("optax")

from flax import nnx  # noqa: E402

import revnet  # noqa: E402
import revnet.nnx as rnnx  # noqa: E402

WIDTH = 8


class Block(nnx.Module):
    """A user's own block: BatchNorm and dropout in f, LayerNorm and dropout in g."""

    def __init__(self, *, rate=0.2, dtype=jnp.float32, rngs):
        half = WIDTH // 2
        self.f = nnx.Sequential(
            nnx.Linear(half, half, param_dtype=dtype, rngs=rngs),
            nnx.BatchNorm(half, param_dtype=dtype, rngs=rngs),
            jnp.tanh,
            nnx.Dropout(rate, rngs=rngs),
        )
        self.g = nnx.Sequential(
            nnx.Linear(half, half, param_dtype=dtype, rngs=rngs),
            nnx.LayerNorm(half, param_dtype=dtype, rngs=rngs),
            jnp.tanh,
            nnx.Dropout(rate, rngs=rngs),
        )

    def __call__(self, x):
        x1, x2 = jnp.split(x, 2, axis=-1)
        y1 = x1 + self.f(x2)
        return jnp.concatenate([y1, x2 + self.g(y1)], axis=-1)


BLOCKS = {d: functools.partial(Block, dtype=d) for d in ("float32", "float64")}
HALF_DROPPED = functools.partial(Block, rate=0.5, dtype="float64")
TRANSFORMER = functools.partial(
    rnnx.ReversibleTransformerBlock, 16, 2, 32, dropout_rate=0.1
)


def coupling_block(*, rngs):
    """The same residual functions through revnet's AdditiveCoupling."""
    block = Block(rngs=rngs)
    return rnnx.AdditiveCoupling(block.f, block.g)


def affine_block(*, rngs):
    half = WIDTH // 2
    net = nnx.Sequential(
        nnx.Linear(half, 16, rngs=rngs),
        nnx.BatchNorm(16, rngs=rngs),
        jnp.tanh,
        nnx.Dropout(0.2, rngs=rngs),
        nnx.Linear(16, WIDTH, rngs=rngs),
    )
    return rnnx.AffineCoupling(net)


def inputs(shape=(16, WIDTH), dtype=jnp.float32, seed=1):
    x = jax.random.normal(jax.random.key(seed), shape, dtype)
    cot = jax.random.normal(jax.random.key(seed + 1), shape, dtype)
    return x, cot


def cast_state(model, dtype):
    """Casts every floating point variable of ``model`` (NNX keeps BatchNorm's
    running statistics in float32 whatever ``param_dtype`` is) to ``dtype``."""
    nnx.update(model, cast_floats(nnx.state(model), dtype))


_BUILT: dict = {}


def twins(block=Block, num_layers=4, dtype=None, **kwargs):
    """The reversible model and its non-reversible twin, same variables.

    Built once per configuration (and NNX mode) and cloned for each test:
    eager NNX creation dispatches every small operation.
    """
    key = (block, num_layers, dtype, tuple(sorted(kwargs.items())))
    key += (nnx.set_graph_mode.current_value(),)
    if key not in _BUILT:
        rev, std = (
            rnnx.ReversibleSequence(
                block, num_layers, rngs=nnx.Rngs(0), reversible=r, **kwargs
            )
            for r in (True, False)
        )
        if dtype is not None:
            cast_state(rev, dtype)
            cast_state(std, dtype)
        np.testing.assert_array_equal(
            jax.tree.leaves(nnx.state(rev))[0], jax.tree.leaves(nnx.state(std))[0]
        )
        _BUILT[key] = rev, std
    return tuple(nnx.clone(m) for m in _BUILT[key])


@nnx.jit
def grads(model, x, cot):
    """Gradients for every parameter leaf and the input, of ``sum(model(x) * cot)``
    (one compiled program: eager NNX dispatches every small operation)."""
    return nnx.grad(lambda m, x: jnp.sum(m(x) * cot), argnums=(0, 1))(model, x)


def check_twins(rev, std, x, cot, dtype=jnp.float32):
    g_rev, g_std = grads(rev, x, cot), grads(std, x, cot)
    assert_trees_close(g_rev, g_std, tolerance(dtype), "gradients")
    assert jax.tree.leaves(g_rev[0]), "no parameter gradients compared"
    return g_rev


@pytest.mark.parametrize(
    "dtype", ["float32", pytest.param("float64", marks=pytest.mark.slow)]
)
def test_gradients_equal_the_twin(dtype):
    with jax.enable_x64(dtype == "float64"):
        rev, std = twins(BLOCKS[dtype], dtype=dtype)
        x, cot = inputs(dtype=dtype)
        g = check_twins(rev, std, x, cot, dtype)
        assert all(leaf.dtype == dtype for leaf in jax.tree.leaves(g))
        # Eight parameter leaves per block, stacked over the four layers.
        assert len(jax.tree.leaves(g[0])) == 8
        assert jax.tree.leaves(g[0])[0].shape[0] == 4


def test_batch_stats_update_once_and_equal_the_twin():
    rev, std = twins()
    before = nnx.clone(rev)
    forward_only = nnx.clone(rev)
    x, cot = inputs()
    grads(rev, x, cot)
    grads(std, x, cot)
    forward_only(x)
    stats = [nnx.state(m, nnx.BatchStat) for m in (rev, std, forward_only, before)]
    assert_trees_close(stats[0], stats[1], tolerance("float32"), "batch stats")
    # One update per step: a training step leaves the same statistics as one
    # forward call (the backward pass's rebuild adds no second update) ...
    assert_trees_close(stats[0], stats[2], tolerance("float32"), "batch stats")
    # ... and that update happened.
    assert not np.allclose(jax.tree.leaves(stats[0])[0], jax.tree.leaves(stats[3])[0])
    counts = [jax.tree.leaves(nnx.state(m, nnx.RngCount)) for m in (rev, std)]
    for c_rev, c_std in zip(*counts, strict=True):
        np.testing.assert_array_equal(c_rev, c_std)
        np.testing.assert_array_equal(c_rev, np.ones(4))


def test_dropout_is_replayed_from_the_rng_streams():
    # In float64: a replayed mask leaves only rounding, which float32 and
    # rate 0.5 (values doubled) through BatchNorm amplify to ~3e-5 on some
    # CPUs; a mask replayed wrong moves gradients by O(1) at either precision.
    with jax.enable_x64(True):
        rev, std = twins(HALF_DROPPED, dtype="float64")
        x, cot = inputs(dtype=jnp.float64)
        eval_rev = nnx.clone(rev)
        eval_rev.eval()
        g_train = check_twins(rev, std, x, cot, jnp.float64)
        # The masks matter: without dropout the input's gradient differs.
        g_eval = grads(eval_rev, x, cot)
        gap = np.max(np.abs(g_train[1] - g_eval[1]))
        assert gap > 0.1 * np.max(np.abs(g_eval[1])), gap
        # A second step draws new masks, and they are replayed too.
        check_twins(rev, std, x, cot, jnp.float64)


def test_inverse_replays_the_dropout_of_the_call():
    model, _ = twins()
    x, _ = inputs()
    before = nnx.clone(model)
    y = model(x)
    np.testing.assert_allclose(
        before.inverse(y), x, atol=tolerance("float32", "round_trip")
    )
    # The call advanced the streams: the model as it is now draws new masks.
    assert not np.allclose(model.inverse(y), x, atol=1e-2)  # far off, not rounding


def test_nnx_jit_optimizer_steps_equal_the_twin():
    x, _ = inputs()
    target = jnp.roll(x, 1, axis=-1)

    @nnx.jit
    def step(model, optimizer):
        loss, g = nnx.value_and_grad(lambda m: jnp.mean((m(x) - target) ** 2))(model)
        optimizer.update(model, g)
        return loss

    models = twins()
    # SGD, not Adam: Adam divides the gradients of biases that feed a
    # BatchNorm (zero in theory, rounding noise in practice) by their own
    # size, which turns noise into full-size steps in both twins.
    opts = [nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param) for m in models]
    history = []
    for _ in range(3):
        losses = [step(m, o) for m, o in zip(models, opts)]
        np.testing.assert_allclose(losses[0], losses[1], rtol=tolerance("float32"))
        history.append(losses[0])
    assert history[-1] < history[0], "the steps did not train"
    states = [nnx.state(m) for m in models]
    rtol = tolerance("float32")
    assert_trees_close(states[0], states[1], rtol, "model after three steps")


@pytest.mark.parametrize(
    "block", [coupling_block, affine_block], ids=["additive", "affine"]
)
def test_couplings_in_a_stack_equal_the_twin(block):
    rev, std = twins(block, num_layers=3)
    x, cot = inputs()
    check_twins(rev, std, x, cot)


@nnx.jit
def _round_trips(add, before, affine, x):
    y, log_det = affine.forward_and_log_det(x)
    jac = jax.vmap(jax.jacfwd(lambda h: affine(h[None])[0]))(x)
    derived = revnet.forward_and_log_det(affine, x, batch_ndim=1)[1]
    return before.inverse(add(x)), affine.inverse(y), (log_det, derived), jac


def test_couplings_on_their_own():
    rngs = nnx.Rngs(0)
    x, _ = inputs(shape=(3, WIDTH))
    add = coupling_block(rngs=rngs)
    affine = rnnx.AffineCoupling(nnx.Linear(4, 8, rngs=rngs), scale="tanh")
    x_add, x_affine, (log_det, derived), jac = _round_trips(
        add, nnx.clone(add), affine, x
    )
    # The hand-written log-det is the one revnet derives from the program.
    rtol, atol = tolerance("float32", "log_det"), tolerance("float32", "log_det_floor")
    np.testing.assert_allclose(log_det, derived, rtol=rtol, atol=atol)
    np.testing.assert_allclose(x_add, x, atol=tolerance("float32", "round_trip"))
    np.testing.assert_allclose(x_affine, x, atol=tolerance("float32", "round_trip"))
    np.testing.assert_allclose(log_det, jnp.linalg.slogdet(jac)[1], rtol=rtol)
    # AdditiveCoupling is exactly the hand-written Block's arithmetic.
    block = Block(rngs=nnx.Rngs(5))
    same = rnnx.AdditiveCoupling(nnx.clone(block).f, nnx.clone(block).g)
    np.testing.assert_allclose(same(x), block(x), rtol=tolerance("float32", "values"))


@pytest.mark.parametrize("scale", ["sigmoid", "tanh", "exp"])
def test_affine_log_det_is_the_derived_one_in_float64(scale):
    """The hand-written log-det against the derived one and slogdet(jacfwd),
    in float64 at 1e-10, with weights large enough to reach the scale's
    bounds."""
    with jax.enable_x64(True):
        net = nnx.Linear(4, 8, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
        net.kernel[...] = 4.0 * net.kernel[...]
        affine = rnnx.AffineCoupling(net, scale=scale)
        x = jax.random.normal(jax.random.key(1), (3, 8), jnp.float64)
        _, log_det = affine.forward_and_log_det(x)
        derived = revnet.forward_and_log_det(affine, x, batch_ndim=1)[1]
        jac = jax.vmap(jax.jacfwd(lambda h: affine(h[None])[0]))(x)
        assert log_det.dtype == jnp.float64
        rtol = tolerance("float64", "log_det")
        atol = tolerance("float64", "log_det_floor")
        np.testing.assert_allclose(log_det, derived, rtol=rtol, atol=atol)
        expected = jnp.linalg.slogdet(jac)[1]
        np.testing.assert_allclose(log_det, expected, rtol=rtol, atol=atol)


def dropout_affine_block(*, rngs):
    """An affine coupling whose net drops units: RNG streams, no BatchNorm."""
    net = nnx.Sequential(
        nnx.Linear(WIDTH // 2, 16, rngs=rngs),
        jnp.tanh,
        nnx.Dropout(0.5, rngs=rngs),
        nnx.Linear(16, WIDTH, rngs=rngs),
    )
    return rnnx.AffineCoupling(net)


# Flows whose blocks hold state that the map does not compute from the input:
# BatchNorm's running statistics in eval mode (passed through), and dropout's
# RNG counters in train mode (advanced on their own).
STATE_FLOWS = {
    "batchnorm-eval": (affine_block, "eval"),
    "dropout": (dropout_affine_block, "train"),
}


def state_flow(name, dtype):
    block, mode = STATE_FLOWS[name]
    rev, std = twins(block, num_layers=2, dtype=dtype)
    for model in (rev, std):
        getattr(model, mode)()
    return rev, std


@nnx.jit
def _flow_grads(model, x, cot, c):
    """Gradients of ``sum(y * cot) + sum(log_det * c)`` for every parameter
    leaf and the input, with ``(y, log_det)``."""

    def loss(m, x):
        y, log_det = m.forward_and_log_det(x)
        return jnp.sum(y * cot) + jnp.sum(log_det * c), (y, log_det)

    return nnx.grad(loss, argnums=(0, 1), has_aux=True)(model, x)


@pytest.mark.parametrize("name", STATE_FLOWS)
def test_log_det_with_state_not_computed_from_the_input(name):
    """The log-det of a flow holding state the map does not compute from x is
    that of the map with the state before the call, per example (its dropout
    masks included), and the state is written back as by a call."""
    with jax.enable_x64(True):
        rev, std = state_flow(name, "float64")
        x, _ = inputs(shape=(6, WIDTH), dtype=jnp.float64)
        graphdef, state = nnx.split(nnx.clone(std))
        called = nnx.clone(rev)
        y, log_det = rev.forward_and_log_det(x)
        ref = batch_block_slogdet(lambda v: nnx.merge(graphdef, state, copy=True)(v), x)
        assert log_det.shape == (6,)
        rtol = tolerance("float64", "log_det")
        atol = tolerance("float64", "log_det_floor")
        np.testing.assert_allclose(log_det, ref, rtol=rtol, atol=atol)
        tol = tolerance("float64", "values")  # the same forward pass
        np.testing.assert_allclose(y, called(x), rtol=tol, atol=tol)
        for kind in (nnx.BatchStat, nnx.RngCount):
            after, expected = (nnx.state(m, kind) for m in (rev, called))
            for a, e in zip(jax.tree.leaves(after), jax.tree.leaves(expected)):
                np.testing.assert_array_equal(a, e)
        if name == "dropout":  # the counters advanced: the next call draws anew
            assert not np.allclose(rev.forward_and_log_det(x)[0], y)


@pytest.mark.parametrize("name", STATE_FLOWS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_log_det_gradients_with_state_equal_the_twin(name, dtype):
    with jax.enable_x64(dtype == "float64"):
        rev, std = state_flow(name, dtype)
        x, cot = inputs(dtype=dtype)
        c = jax.random.normal(jax.random.key(7), (x.shape[0],), dtype)
        (g_rev, out_rev), (g_std, out_std) = (
            _flow_grads(m, x, cot, c) for m in (rev, std)
        )
        rtol = tolerance(dtype)
        assert_trees_close(out_rev, out_std, rtol, "outputs")
        assert_trees_close(g_rev, g_std, rtol, "gradients")
        assert len(jax.tree.leaves(g_rev[0])) >= 4, "no parameter gradients"


def test_log_det_with_batch_statistics_in_training_mode_is_refused():
    rev, _ = twins(affine_block, num_layers=2)
    with pytest.raises(ValueError, match="new state is computed from the input"):
        rev.forward_and_log_det(inputs()[0])


def test_transformer_block_equals_the_twin_and_inverts():
    rev, std = twins(TRANSFORMER, num_layers=2)
    x, cot = inputs(shape=(2, 5, 16))
    check_twins(rev, std, x, cot)
    before = nnx.clone(rev)
    x_back = nnx.jit(lambda before, model: before.inverse(model(x)))(before, rev)
    np.testing.assert_allclose(x_back, x, atol=tolerance("float32", "round_trip"))


def test_anchors_and_drift_monitor():
    monitor = revnet.DriftMonitor()
    rev = rnnx.ReversibleSequence(
        Block, 6, rngs=nnx.Rngs(0), anchor_every=2, drift=monitor
    )
    _, std = twins(num_layers=6)
    x, cot = inputs()
    check_twins(rev, std, x, cot)
    jax.effects_barrier()
    assert monitor.latest is not None and len(monitor.latest) == 3
    assert 0 < monitor.max() < 1e-4  # float32 drift readings: rounding, not a gradient


def test_tree_mode():
    """NNX's tree mode (modules as pytrees): the same twins, the same updates."""
    x, cot = inputs()
    with nnx.set_graph_mode(False):
        models = twins()

        @nnx.jit
        def step(model):
            graphdef, params, rest = nnx.split(model, nnx.Param, ...)

            def loss(params, rest, x):
                return jnp.sum(nnx.merge(graphdef, params, rest)(x) * cot)

            return nnx.grad(loss, argnums=(0, 2))(params, rest, x)

        g = [step(m) for m in models]
    assert_trees_close(g[0], g[1], tolerance("float32"), "tree-mode gradients")
    stats = [nnx.state(m, nnx.BatchStat) for m in models]
    assert_trees_close(stats[0], stats[1], tolerance("float32"), "batch stats")
    for count in jax.tree.leaves(nnx.state(models[0], nnx.RngCount)):
        np.testing.assert_array_equal(count, np.ones(4))


def test_hijax_mode_is_refused_in_one_line():
    with nnx.var_defaults(hijax=True):
        with pytest.raises(TypeError, match="hijax/ref variable mode is on") as e:
            rnnx.ReversibleSequence(Block, 2, rngs=nnx.Rngs(0))
        assert "\n" not in str(e.value)
        add = rnnx.AdditiveCoupling(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), jnp.tanh)
    with pytest.raises(TypeError, match="'f/bias' is a hijax/ref variable") as e:
        add.inverse(jnp.ones([2, 8]))
    assert "\n" not in str(e.value)


class Grows(nnx.Module):
    def __init__(self, *, rngs):
        self.lin = nnx.Linear(WIDTH, 2 * WIDTH, rngs=rngs)

    def __call__(self, x):
        return self.lin(x)


def seq(block=Block, num_layers=2, **kwargs):
    kwargs.setdefault("rngs", nnx.Rngs(0))
    return rnnx.ReversibleSequence(block, num_layers, **kwargs)


def ones(*shape, dtype=jnp.float32):
    return jnp.ones(shape, dtype)


BAD_INPUT = [
    (lambda: seq(3), TypeError, "block must be a callable or a non-empty list"),
    (lambda: seq(num_layers=0), ValueError, "num_layers must be a positive"),
    (lambda: seq(rngs=0), TypeError, "rngs must be an nnx.Rngs"),
    (lambda: seq(reversible="yes"), TypeError, "reversible must be"),
    (lambda: seq(anchor_every=0), ValueError, "anchor_every must be"),
    (lambda: seq(decisions="x"), ValueError, "decisions"),
    (lambda: seq(lambda rngs: jnp.tanh), TypeError, "must create an nnx.Module"),
    (
        lambda: seq(nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(0))),
        TypeError,
        r"block must create a block, got an instance of Linear; pass its class or "
        r"a function, such as lambda rngs: Linear\(\.\.\., rngs=rngs\)",
    ),
    (lambda: rnnx.AdditiveCoupling(jnp.tanh, 3), TypeError, "g must be callable"),
    (lambda: rnnx.AffineCoupling(jnp.tanh, scale="x"), ValueError, "scale must be"),
    (
        lambda: rnnx.AffineCoupling(jnp.tanh, scale_bound=2.0),
        ValueError,
        "scale_bound must be None unless",
    ),
    (
        lambda: rnnx.ReversibleTransformerBlock(15, 2, 8, rngs=nnx.Rngs(0)),
        ValueError,
        "model_size must be even",
    ),
    (lambda: seq()(ones(2, 8, dtype=jnp.int32)), TypeError, "floating point input"),
    (lambda: seq(Grows)(ones(2, WIDTH)), ValueError, "must preserve its input's"),
    (
        lambda: rnnx.AdditiveCoupling(jnp.tanh, jnp.tanh)(ones(2, 7)),
        ValueError,
        "must be even",
    ),
]


@pytest.mark.parametrize("make, error, match", BAD_INPUT)
def test_bad_input_gets_a_one_line_error(make, error, match):
    with pytest.raises(error, match=match) as e:
        make()
    assert "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("name", ["coupling", "flow", "sequence", "transformer"])
@pytest.mark.slow
def test_docstring_examples(name):
    module = importlib.import_module(f"revnet.nnx.{name}")
    names = {n: getattr(rnnx, n) for n in rnnx.__all__}
    globs = {"functools": functools, "jax": jax, "jnp": jnp, "nnx": nnx, **names}
    result = doctest.testmod(module, extraglobs=globs)
    assert result.attempted > 0
    assert result.failed == 0


@pytest.mark.slow
def test_digits_training_loss_matches_the_twin_every_step():
    losses = load_example("digits_nnx").train(50)
    rev, std = (np.asarray(losses[t]) for t in ("reversible", "standard"))
    assert len(rev) == 50
    np.testing.assert_array_less(np.abs(rev - std), 1e-4)  # losses of 50 float32 steps
    assert rev[-5:].mean() < 0.5 * rev[:5].mean(), "the model did not train"


@pytest.mark.slow
def test_digits_example_smoke_run():
    script = os.path.join(ROOT, "examples", "digits_nnx.py")
    out = subprocess.run(
        [sys.executable, script, "--smoke"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "compiled training step temp memory" in out.stdout
    assert "largest loss gap over 3 steps" in out.stdout
