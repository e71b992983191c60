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
from tests.helpers import assert_trees_close, load_example, tolerance  # noqa: E402

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
        np.testing.assert_allclose(log_det, expected, rtol=1e-5, atol=1e-6)
        # The hand-written log-det is the one revnet derives from the program.
        _, derived = revnet.forward_and_log_det(block, x)
        np.testing.assert_allclose(log_det, derived, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(block.inverse(block(x)), x, rtol=1e-5, atol=1e-5)


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
        np.testing.assert_allclose(log_det, derived, rtol=1e-10, atol=1e-12)
        _, expected = jnp.linalg.slogdet(jax.jacfwd(block)(x))
        np.testing.assert_allclose(log_det, expected, rtol=1e-10, atol=1e-12)


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
    # A call consumes its state (Equinox's rule); the inverse reads a copy.
    copy = jax.tree.unflatten(jax.tree.structure(state), jax.tree.leaves(state))
    y, new_state = seq(x, state, key=key)
    state = copy
    np.testing.assert_allclose(seq.inverse(y, state, key=key), x, atol=1e-5)
    # Another key is another dropout mask: the inverse then misses x.
    wrong = seq.inverse(y, state, key=jax.random.key(3))
    assert not np.allclose(wrong, x, atol=1e-2)
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
    assert max(gaps) <= 1e-4, gaps
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
