"""The Equinox door: ``revnet.eqx.ReversibleSequence`` of a user's coupling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from tests.doors import BATCH, RATE, WIDTH, Built

REQUIRES = "equinox"
pytest.importorskip(
    REQUIRES, reason="the equinox door needs equinox: pip install 'revnet[equinox]'"
)

import equinox as eqx  # noqa: E402

import revnet.eqx  # noqa: E402


class Residual(eqx.Module):
    """Linear, BatchNorm over the batch axis, tanh, dropout: one example."""

    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    dropout: eqx.nn.Dropout

    def __init__(self, size, *, key, dtype):
        self.linear = eqx.nn.Linear(size, size, key=key, dtype=dtype)
        self.norm = eqx.nn.BatchNorm(
            size, axis_name="batch", momentum=0.9, mode="ema", dtype=dtype
        )
        self.dropout = eqx.nn.Dropout(RATE)

    def __call__(self, h, state, *, key):
        u, state = self.norm(self.linear(h), state)
        return self.dropout(jnp.tanh(u), key=key), state


def build(depth, *, dtype, reversible, anchor_every=None, drift=None, seed=0):
    half = WIDTH // 2

    def make_block(key):
        kf, kg = jax.random.split(key)
        return revnet.eqx.AdditiveCoupling(
            Residual(half, key=kf, dtype=dtype), Residual(half, key=kg, dtype=dtype)
        )

    seq, state = eqx.nn.make_with_state(revnet.eqx.ReversibleSequence)(
        make_block,
        depth,
        key=jax.random.key(seed),
        reversible=reversible,
        anchor_every=anchor_every,
        drift=drift,
    )
    # The trainable leaves are the blocks' floating point arrays; the
    # sequence's own (static) options make the rest of the tree.
    params, static = eqx.partition(seq.blocks, eqx.is_inexact_array)
    x = jax.random.normal(jax.random.key(seed + 1), (BATCH, WIDTH), dtype)

    def apply(params, state, x, key):
        model = eqx.tree_at(lambda s: s.blocks, seq, eqx.combine(params, static))
        return model(x, state, key=key)

    return Built(params, state, apply, x)
