"""The Equinox front door, ``revnet.eqx``: idiomatic use and its errors.

The cross-door rows it shares with Haiku and NNX (BatchNorm, dropout, memory,
anchors) are in tests/doors/test_table.py.
"""

from __future__ import annotations

import copy
import doctest
import pickle
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

eqx = pytest.importorskip(
    "equinox", reason="revnet.eqx needs equinox: pip install '.[equinox]'"
)
optax = pytest.importorskip("optax")

import revnet  # noqa: E402
import revnet.eqx  # noqa: E402
from revnet.eqx import coupling, flow, sequence  # noqa: E402
from tests.helpers import (  # noqa: E402
    assert_trees_close,
    batch_block_slogdet,
    load_example,
    tolerance,
)

F64 = pytest.param(jnp.float64, id="f64", marks=pytest.mark.slow)
DTYPES = [pytest.param(jnp.float32, id="f32"), F64]


class Residual(eqx.Module):
    """A user's residual function: linear, LayerNorm, tanh (one example)."""

    linear: eqx.nn.Linear
    norm: eqx.nn.LayerNorm

    def __init__(self, size, *, key, dtype=None):
        self.linear = eqx.nn.Linear(size, size, key=key, dtype=dtype)
        self.norm = eqx.nn.LayerNorm(size, dtype=dtype)

    def __call__(self, h, *, key=None):
        return jnp.tanh(self.norm(self.linear(h)))


def make_block(half, dtype=None):
    def make(key):
        kf, kg = jax.random.split(key)
        return revnet.eqx.AdditiveCoupling(
            Residual(half, key=kf, dtype=dtype), Residual(half, key=kg, dtype=dtype)
        )

    return make


def x64(dtype):
    return jax.enable_x64(jnp.dtype(dtype) == jnp.float64)


@pytest.mark.parametrize("module", [coupling, flow, sequence])
@pytest.mark.slow
def test_docstring_examples(module):
    names = {n: getattr(revnet.eqx, n) for n in revnet.eqx.__all__}
    result = doctest.testmod(
        module,
        extraglobs={"jax": jax, "jnp": jnp, "eqx": eqx, "revnet": revnet, **names},
    )
    assert result.attempted > 0
    assert result.failed == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_filter_grad_under_filter_jit_equals_the_twin(dtype):
    with x64(dtype):
        x = jax.random.normal(jax.random.key(1), (6, 8), dtype)
        grads = {}
        for reversible in (True, False):
            seq = revnet.eqx.ReversibleSequence(
                make_block(4, dtype), 4, key=jax.random.key(0), reversible=reversible
            )

            @eqx.filter_jit
            def grad(seq, x):
                return eqx.filter_grad(lambda s, x: jnp.sum(jnp.sin(s(x))))(seq, x)

            grads[reversible] = (
                grad(seq, x).blocks,
                jax.grad(lambda x: jnp.sum(jnp.sin(seq(x))))(x),
            )
        rtol = tolerance(dtype, loops=True)
        assert_trees_close(grads[True], grads[False], rtol, "grads")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["additive", "affine"])
def test_couplings_grads_equal_plain_autodiff(kind, dtype):
    with x64(dtype):
        k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
        if kind == "additive":
            block = make_block(4, dtype)(k1)
        else:
            net = eqx.nn.MLP(4, 8, 16, 1, activation=jnp.tanh, key=k1, dtype=dtype)
            block = revnet.eqx.AffineCoupling(net, scale="tanh")
        x = jax.random.normal(k2, (5, 8), dtype)

        params, rest = eqx.partition(block, eqx.is_inexact_array)

        def loss(params, x, reversible):
            fn = jax.vmap(eqx.combine(params, rest))
            y = (revnet.invertible(fn) if reversible else fn)(x)
            return jnp.sum(jnp.sin(y))

        rev, std = (jax.grad(loss, (0, 1))(params, x, r) for r in (True, False))
        assert_trees_close(rev, std, tolerance(dtype), f"{kind} grads")


@pytest.mark.slow
def test_affine_log_det_is_the_log_jacobian_determinant():
    net = eqx.nn.MLP(3, 6, 16, 1, activation=jnp.tanh, key=jax.random.key(0))
    for scale in ("sigmoid", "tanh", "exp"):
        block = revnet.eqx.AffineCoupling(net, scale=scale)
        x = jax.random.normal(jax.random.key(1), (6,))
        _, log_det = block.forward_and_log_det(x)
        _, expected = jnp.linalg.slogdet(jax.jacfwd(block)(x))
        rtol = tolerance("float32", "log_det")
        atol = tolerance("float32", "log_det_floor")
        np.testing.assert_allclose(log_det, expected, rtol=rtol, atol=atol)
        # The hand-written log-det is the one revnet derives from the program.
        _, derived = revnet.forward_and_log_det(block, x)
        np.testing.assert_allclose(log_det, derived, rtol=rtol, atol=atol)
        tol = tolerance("float32", "round_trip")
        np.testing.assert_allclose(block.inverse(block(x)), x, rtol=tol, atol=tol)


@pytest.mark.parametrize("scale", ["sigmoid", "tanh", "exp"])
def test_affine_log_det_is_the_derived_one_in_float64(scale):
    """The hand-written log-det against the derived one and slogdet(jacfwd),
    in float64 at 1e-10, with weights large enough to reach the scale's
    bounds."""
    with jax.enable_x64(True):
        net = eqx.nn.MLP(
            3, 6, 16, 1, activation=jnp.tanh, key=jax.random.key(0), dtype=jnp.float64
        )
        net = eqx.tree_at(lambda n: n.layers[-1].weight, net, 4 * net.layers[-1].weight)
        block = revnet.eqx.AffineCoupling(net, scale=scale)
        x = jax.random.normal(jax.random.key(1), (6,), jnp.float64)
        _, log_det = block.forward_and_log_det(x)
        _, derived = revnet.forward_and_log_det(block, x)
        assert log_det.dtype == jnp.float64
        rtol = tolerance("float64", "log_det")
        atol = tolerance("float64", "log_det_floor")
        np.testing.assert_allclose(log_det, derived, rtol=rtol, atol=atol)
        _, expected = jnp.linalg.slogdet(jax.jacfwd(block)(x))
        np.testing.assert_allclose(log_det, expected, rtol=rtol, atol=atol)


class NormDropResidual(eqx.Module):
    """BatchNorm over the batch axis and dropout: state and a key."""

    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    dropout: eqx.nn.Dropout

    def __init__(self, size, *, key):
        self.linear = eqx.nn.Linear(size, size, key=key)
        self.norm = eqx.nn.BatchNorm(size, axis_name="batch", mode="ema")
        self.dropout = eqx.nn.Dropout(0.2)

    def __call__(self, h, state, *, key):
        u, state = self.norm(self.linear(h), state)
        return self.dropout(jnp.tanh(u), key=key), state


def stateful_block(key):
    kf, kg = jax.random.split(key)
    return revnet.eqx.AdditiveCoupling(
        NormDropResidual(4, key=kf), NormDropResidual(4, key=kg)
    )


def test_inverse_replays_state_and_dropout():
    seq, state = eqx.nn.make_with_state(revnet.eqx.ReversibleSequence)(
        stateful_block, 5, key=jax.random.key(0)
    )
    x = jax.random.normal(jax.random.key(1), (8, 8))
    key = jax.random.key(2)
    # The inverse reads the very state the call was given, as documented: the
    # call updates a clone, so Equinox does not mark it used.
    y, new_state = seq(x, state, key=key)
    back = seq.inverse(y, state, key=key)
    np.testing.assert_allclose(back, x, atol=tolerance("float32", "round_trip"))
    # Another key is another dropout mask: the inverse then misses x.
    wrong = seq.inverse(y, state, key=jax.random.key(3))
    assert not np.allclose(wrong, x, atol=1e-2)  # far off, not rounding
    assert isinstance(new_state, eqx.nn.State)


@pytest.mark.slow
def test_one_optax_step_equals_the_twins():
    x = jax.random.normal(jax.random.key(1), (8, 8))
    key = jax.random.key(2)
    # SGD: Adam would turn the rounding noise of the linear biases in front of
    # the BatchNorms (zero gradient in theory) into steps of the full rate.
    optimiser = optax.sgd(0.1)
    new = {}
    for reversible in (True, False):
        seq, state = eqx.nn.make_with_state(revnet.eqx.ReversibleSequence)(
            stateful_block, 3, key=jax.random.key(0), reversible=reversible
        )
        opt_state = optimiser.init(eqx.filter(seq, eqx.is_inexact_array))

        @eqx.filter_jit
        def step(seq, state, opt_state):
            def loss(seq):
                y, state_ = seq(x, state, key=key)
                return jnp.sum(y**2), state_

            (_, state_), grads = eqx.filter_value_and_grad(loss, has_aux=True)(seq)
            params = eqx.filter(seq, eqx.is_inexact_array)
            updates, opt_state = optimiser.update(grads, opt_state, params)
            return eqx.apply_updates(seq, updates), state_, opt_state

        seq, state, _ = step(seq, state, opt_state)
        new[reversible] = (eqx.filter(seq.blocks, eqx.is_inexact_array), state)
    assert_trees_close(new[True], new[False], tolerance(jnp.float32, loops=True))


class NoKey(eqx.Module):
    """A block whose ``__call__`` takes no ``key=``."""

    lin: eqx.nn.Linear

    def __init__(self, key):
        self.lin = eqx.nn.Linear(8, 8, key=key)

    def __call__(self, h):
        return h + self.lin(h)


def _seq(**kwargs):
    return revnet.eqx.ReversibleSequence(
        make_block(4), **{"num_layers": 2, "key": jax.random.key(0), **kwargs}
    )


@pytest.mark.parametrize(
    "build, error, match",
    [
        (
            lambda: revnet.eqx.ReversibleSequence(3, 2, key=jax.random.key(0)),
            TypeError,
            "make_block must be a callable or a non-empty list",
        ),
        (lambda: _seq(num_layers=0), ValueError, "num_layers must be a positive"),
        (
            lambda: revnet.eqx.ReversibleSequence(
                eqx.nn.Linear(8, 8, key=jax.random.key(0)), 2, key=jax.random.key(0)
            ),
            TypeError,
            r"make_block must build a block from a PRNG key, got an instance of "
            r"Linear; pass a function, such as lambda key: Linear\(\.\.\., key=key\)",
        ),
        (
            lambda: revnet.eqx.ReversibleSequence(
                lambda k: NoKey(k), 2, key=jax.random.key(0)
            ),
            TypeError,
            r"the block NoKey must take a key= argument .* add key=None",
        ),
        (lambda: _seq(key=0), TypeError, "key must be a PRNG key"),
        (lambda: _seq(anchor_every=0), ValueError, "anchor_every must be a positive"),
        (lambda: _seq(drift=1e-3), TypeError, "drift must be a revnet.DriftMonitor"),
        (lambda: _seq(decisions="maybe"), ValueError, "decisions must be one of"),
        (
            lambda: _seq()(jnp.ones(8)),
            ValueError,
            r"expected an input of shape "
            r"\[batch, \.\.\.\]",
        ),
        (lambda: _seq()(jnp.ones([2, 8], jnp.int32)), TypeError, "floating point"),
        (lambda: _seq()(jnp.ones([2, 7])), ValueError, "the last axis is split"),
        (
            lambda: revnet.eqx.ReversibleSequence(
                lambda k: revnet.eqx.AdditiveCoupling(
                    Residual(4, key=k), lambda h, key=None: h[:3]
                ),
                2,
                key=jax.random.key(0),
            )(jnp.ones([2, 8])),
            ValueError,
            r"^AdditiveCoupling: g must return an array of shape \(4,\), got \(3,\)",
        ),
        (
            lambda: revnet.eqx.ReversibleSequence(
                stateful_block, 2, key=jax.random.key(0)
            )(jnp.ones([2, 8])),
            ValueError,
            "^ReversibleSequence: the block holds state .such as eqx.nn.BatchNorm",
        ),
        (
            lambda: revnet.eqx.ReversibleSequence(
                stateful_block, 2, key=jax.random.key(0)
            )(jnp.ones([2, 8])),
            ValueError,
            r"no state was given; .*: model\(x, state, key=key\)\.$",
        ),
        (
            lambda: revnet.eqx.ReversibleSequence(
                stateful_block, 2, key=jax.random.key(0)
            ).forward_and_log_det(jnp.ones([2, 8])),
            ValueError,
            r": model\.forward_and_log_det\(x, state, key=key\)\.$",
        ),
        (
            lambda: revnet.eqx.AffineCoupling(jnp.tanh, scale="cube"),
            ValueError,
            "scale must be one of",
        ),
        (
            lambda: revnet.eqx.AffineCoupling(jnp.tanh, scale_bound=2.0),
            ValueError,
            "scale_bound must be None unless scale='tanh'",
        ),
        (
            lambda: revnet.eqx.AdditiveCoupling(jnp.tanh, 1),
            TypeError,
            "g must be callable",
        ),
    ],
)
def test_bad_input_is_named_in_one_line(build, error, match):
    with pytest.raises(error) as info:
        build()
    # JAX may append its traceback note below an error raised while tracing.
    message = str(info.value).splitlines()[0]
    assert re.search(match, message), message


@pytest.mark.parametrize("method", ["__call__", "forward_and_log_det", "inverse"])
def test_a_width_mismatch_is_named_as_one(method):
    """x's examples are not the width the blocks were built for: the message
    says so, and does not suggest that x is one example."""
    with pytest.raises(TypeError) as info:
        getattr(_seq(), method)(jnp.ones([2, 6]))
    message = str(info.value).splitlines()[0]
    assert message.startswith("ReversibleSequence: the block failed on one "), message
    assert "of shape (6,)" in message, message
    assert "per-example shape the blocks were built for" in message, message
    assert "axis_name=None" not in message, message


def test_one_example_given_as_a_batch_is_named_as_one():
    """Blocks built for ONE example of shape [3, 4] (a residual mixing its
    rows), given that example: the sequence vmaps it over its rows, which
    fails, while the whole of x runs as one example."""

    def rows(h, key=None):
        return jnp.tanh(jnp.full((3, 3), 0.1) @ h)

    seq = revnet.eqx.ReversibleSequence(
        lambda k: revnet.eqx.AdditiveCoupling(rows, rows), 2, key=jax.random.key(0)
    )
    x = jnp.ones([3, 4])
    with pytest.raises((TypeError, ValueError)) as info:
        seq(x)
    message = str(info.value).splitlines()[0]
    assert "runs on all of x as one example" in message, message
    assert "axis_name=None and jax.vmap" in message, message
    seq = revnet.eqx.ReversibleSequence(
        lambda k: revnet.eqx.AdditiveCoupling(rows, rows),
        2,
        key=jax.random.key(0),
        axis_name=None,
    )
    assert jax.vmap(seq)(x[None]).shape == (1, 3, 4)


class DropNet(eqx.Module):
    """An affine coupling's net with dropout (one example)."""

    first: eqx.nn.Linear
    dropout: eqx.nn.Dropout
    last: eqx.nn.Linear

    def __init__(self, *, key, dtype):
        k1, k2 = jax.random.split(key)
        self.first = eqx.nn.Linear(4, 16, key=k1, dtype=dtype)
        self.dropout = eqx.nn.Dropout(0.5)
        self.last = eqx.nn.Linear(16, 8, key=k2, dtype=dtype)

    def __call__(self, h, *, key=None):
        return self.last(self.dropout(jnp.tanh(self.first(h)), key=key))


class NormNet(DropNet):
    """The same with BatchNorm over the batch axis before the dropout."""

    norm: eqx.nn.BatchNorm

    def __init__(self, *, key, dtype):
        super().__init__(key=key, dtype=dtype)
        self.norm = eqx.nn.BatchNorm(16, axis_name="batch", dtype=dtype)

    def __call__(self, h, state, *, key=None):
        u, state = self.norm(self.first(h), state)
        return self.last(self.dropout(jnp.tanh(u), key=key)), state


def state_flows(name, dtype, num_layers=2):
    """The flow and its non-reversible twin, with the state (or None) and the
    key they run with: BatchNorm in inference mode (its state passed
    through), or dropout in training mode (its masks drawn from the key)."""
    net = NormNet if name == "batchnorm-inference" else DropNet
    models = []
    for reversible in (True, False):
        model, state = eqx.nn.make_with_state(revnet.eqx.ReversibleSequence)(
            lambda k: revnet.eqx.AffineCoupling(net(key=k, dtype=dtype)),
            num_layers,
            key=jax.random.key(0),
            reversible=reversible,
        )
        if name == "batchnorm-inference":
            model = eqx.nn.inference_mode(model)
        else:
            state = None
        models.append(model)
    return models, state, jax.random.key(5)


def _state_copy(state):
    """A fresh ``eqx.nn.State`` with the same values (a call retires its
    state)."""
    return None if state is None else jax.tree.map(lambda a: a, state)


STATE_FLOWS = ["batchnorm-inference", "dropout"]


@pytest.mark.parametrize("name", STATE_FLOWS)
def test_log_det_with_state_not_computed_from_the_input(name):
    """BatchNorm in inference mode returns its state unchanged, dropout draws
    from the key: the log-det is the map's, per example, with that state and
    key (dropout masks included), checked against slogdet(jacfwd) of the
    twin's map in float64; the state comes back as a call returns it."""
    with jax.enable_x64(True):
        (rev, std), state, key = state_flows(name, jnp.float64)
        x = jax.random.normal(jax.random.key(1), (6, 8), jnp.float64)

        def twin(v):
            out = std(v, _state_copy(state), key=key)
            return out if state is None else out[0]

        out = rev.forward_and_log_det(x, _state_copy(state), key=key)
        called = rev(x, _state_copy(state), key=key)
        y, log_det = out[:2]
        assert len(out) == (2 if state is None else 3)
        np.testing.assert_allclose(y, called if state is None else called[0])
        ref = batch_block_slogdet(twin, x)
        assert log_det.shape == (6,)
        rtol = tolerance("float64", "log_det")
        atol = tolerance("float64", "log_det_floor")
        np.testing.assert_allclose(log_det, ref, rtol=rtol, atol=atol)
        if state is not None:
            for a, e in zip(jax.tree.leaves(out[2]), jax.tree.leaves(called[1])):
                np.testing.assert_array_equal(a, e)


@pytest.mark.parametrize("name", STATE_FLOWS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=["f32", "f64"])
def test_log_det_gradients_with_state_equal_the_twin(name, dtype):
    with x64(dtype):
        models, state, key = state_flows(name, dtype)
        x = jax.random.normal(jax.random.key(1), (6, 8), dtype)
        cot = jax.random.normal(jax.random.key(2), (6, 8), dtype)
        c = jax.random.normal(jax.random.key(3), (6,), dtype)

        @eqx.filter_jit
        def grads(model, x, state):
            def loss(model, x):
                fresh = _state_copy(state)
                y, log_det = model.forward_and_log_det(x, fresh, key=key)[:2]
                return jnp.sum(y * cot) + jnp.sum(log_det * c)

            return eqx.filter_grad(loss)(model, x).blocks, jax.grad(loss, 1)(model, x)

        rev, std = (grads(m, x, _state_copy(state)) for m in models)
        assert_trees_close(rev, std, tolerance(dtype), "gradients")
        assert len(jax.tree.leaves(rev[0])) >= 4, "no parameter gradients"


def test_log_det_with_batch_statistics_in_training_mode_is_refused():
    (rev, _), state, key = state_flows("batchnorm-inference", jnp.float32)
    rev = eqx.nn.inference_mode(rev, False)
    with pytest.raises(ValueError, match="new state is computed from the input"):
        rev.forward_and_log_det(jnp.ones([4, 8]), state, key=key)


@pytest.mark.slow
def test_example_smoke_run():
    results = load_example("digits_eqx").main(["--smoke"])
    assert len(results["history"]) == 3
    assert results["temp_bytes"]["reversible"] < results["temp_bytes"]["standard"]


@pytest.mark.slow
def test_digits_training_matches_the_twin_for_50_steps():
    """A user's Equinox block with BatchNorm and dropout in its residual
    functions trains with optax; the loss equals the twin's at every step."""
    history = load_example("digits_eqx").main(["--steps", "50"])["history"]
    assert len(history) == 50
    gaps = [h["gap"] for h in history]
    print(f"largest loss gap over 50 steps: {max(gaps):.1e}")
    assert max(gaps) <= 1e-4, gaps  # losses of 50 float32 training steps
    first, last = history[0]["loss"], history[-1]["loss"]
    assert last["reversible"] < 0.5 * first["reversible"]  # it trains


def test_a_model_holding_a_drift_monitor_is_deep_copied_and_pickled():
    monitor = revnet.DriftMonitor(tolerance=1.0)
    model = _seq(anchor_every=1, drift=monitor)
    x = jax.random.normal(jax.random.key(1), (3, 8))
    jax.grad(lambda m: jnp.sum(m(x) ** 2))(model)
    jax.effects_barrier()
    assert monitor.readings
    for again in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):  # noqa: S301
        assert isinstance(again.drift, revnet.DriftMonitor)
        assert again.drift is not monitor
        assert again.drift.max() == monitor.max() > 0
        np.testing.assert_array_equal(again(x), model(x))
