"""The Haiku door: ``revnet.blocks.ReversibleSequence`` of a user's coupling."""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp

from revnet import blocks
from tests.doors import BATCH, RATE, WIDTH, Built

REQUIRES = None


def residual(h):
    u = hk.Linear(h.shape[-1])(h)
    u = hk.BatchNorm(True, True, decay_rate=0.9)(u, is_training=True)
    return hk.dropout(hk.next_rng_key(), RATE, jnp.tanh(u))


def block(x):
    return blocks.AdditiveCoupling(residual, residual)(x)


def build(depth, *, dtype, reversible, anchor_every=None, drift=None, seed=0):
    def model(x):
        seq = blocks.ReversibleSequence(
            block,
            depth,
            reversible=reversible,
            anchor_every=anchor_every,
            drift=drift,
        )
        return seq(x)

    net = hk.transform_with_state(model)
    x = jax.random.normal(jax.random.PRNGKey(seed + 1), (BATCH, WIDTH), dtype)
    params, state = net.init(jax.random.PRNGKey(seed), x)

    def apply(params, state, x, key):
        return net.apply(params, state, key, x)

    return Built(params, state, apply, x)
