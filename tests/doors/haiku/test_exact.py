"""``exact=True`` on Haiku's models: ``ReversibleTransformer`` and ``RevNet``.

Their blocks hold reductions (LayerNorm, softmax, BatchNorm), which XLA may
sum in another order in the backward program than in the forward one, so
their gradients match the plain twin's to rounding, not bit for bit (see the
numerical-accuracy guide). What exact mode promises still holds: with the
input on the grid, every anchor's reconstruction is exact, read by a
``DriftMonitor`` over several backward passes.
"""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import revnet
from revnet import blocks
from tests.helpers import assert_trees_close, runtime_checks, tolerance

pytestmark = pytest.mark.slow  # several deep backward passes


def _transformer(monitor=None, reversible=True):
    def net(x):
        x = revnet.exact.grid(x)
        encoder = blocks.ReversibleTransformer(
            32,
            2,
            32,
            64,
            dropout_rate=0.1,
            reversible=reversible,
            exact=True,
            anchor_every=4 if monitor else None,
            drift=monitor,
        )
        return encoder(x, True)

    return hk.transform(net)


def test_transformer_rebuilds_every_anchor_bit_for_bit():
    monitor = revnet.DriftMonitor()
    net = _transformer(monitor)
    x = jax.random.normal(jax.random.key(0), (4, 8, 32))
    params = net.init(jax.random.key(1), x)
    grad = jax.jit(jax.grad(lambda p, x, k: jnp.sum(jnp.sin(net.apply(p, k, x)))))
    with runtime_checks(False):
        for seed in range(5):
            x = jax.random.normal(jax.random.key(100 + seed), (4, 8, 32))
            jax.block_until_ready(grad(params, x, jax.random.key(seed)))
    jax.effects_barrier()
    readings = [r.drift for r in monitor.readings]
    assert len(readings) == 5 and all(len(r) == 8 for r in readings), readings
    assert all(np.all(np.asarray(r) == 0) for r in readings), readings


def test_transformer_gradients_match_the_plain_twin():
    x = jax.random.normal(jax.random.key(0), (4, 8, 32))
    params = _transformer().init(jax.random.key(1), x)

    def grads(reversible):
        net = _transformer(reversible=reversible)

        def loss(p, x):
            return jnp.sum(jnp.sin(net.apply(p, jax.random.key(2), x)))

        return jax.jit(jax.grad(loss, (0, 1)))(params, x)

    assert_trees_close(grads(True), grads(False), rtol=tolerance(jnp.float32))


def test_revnet_stage_streams_are_rebuilt_exactly_after_their_entry():
    monitor = revnet.DriftMonitor()

    def net(x):
        model = blocks.RevNet("tiny", 10, exact=True, anchor_every=1, drift=monitor)
        return model(x, True)

    net = hk.transform_with_state(net)
    x = jax.random.normal(jax.random.key(0), (2, 16, 16, 3))
    params, state = net.init(jax.random.key(1), x)
    loss = jax.jit(jax.grad(lambda p, x: jnp.sum(net.apply(p, state, None, x)[0])))
    with runtime_checks(False):
        jax.block_until_ready(loss(params, x))
    jax.effects_barrier()
    readings = monitor.readings
    assert readings, "one reading per stage"
    for reading in readings:
        drift = np.asarray(reading.drift)
        # The first unit rounds the stage's input (a transition's output,
        # off the grid); every later unit is rebuilt bit for bit.
        assert np.all(drift[1:] == 0), reading
