"""The Flax NNX door: ``revnet.nnx.ReversibleSequence`` of a user's coupling.

The model is built the NNX way (``nnx.Module``\\ s created with ``nnx.Rngs``)
and exposed functionally through ``nnx.split``/``nnx.merge``. The door's
dropout ``key`` reseeds the blocks' ``dropout`` streams (``nnx.reseed``, one
key per layer), so the same key gives the same masks, as in the other doors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from tests.doors import BATCH, RATE, WIDTH, Built
from tests.helpers import cast_floats

REQUIRES = "flax"
pytest.importorskip(
    REQUIRES, reason="the nnx door needs flax: pip install 'revnet[nnx]'"
)

from flax import nnx  # noqa: E402

import revnet.nnx  # noqa: E402


class Residual(nnx.Module):
    """Linear, BatchNorm over the batch axis, tanh, dropout."""

    def __init__(self, size, *, dtype, rngs):
        self.linear = nnx.Linear(size, size, param_dtype=dtype, rngs=rngs)
        self.norm = nnx.BatchNorm(size, momentum=0.9, param_dtype=dtype, rngs=rngs)
        self.dropout = nnx.Dropout(RATE, rngs=rngs)

    def __call__(self, h):
        return self.dropout(jnp.tanh(self.norm(self.linear(h))))


def build(depth, *, dtype, reversible, anchor_every=None, drift=None, seed=0):
    half = WIDTH // 2

    def block(rngs):
        return revnet.nnx.AdditiveCoupling(
            Residual(half, dtype=dtype, rngs=rngs),
            Residual(half, dtype=dtype, rngs=rngs),
        )

    model = revnet.nnx.ReversibleSequence(
        block,
        depth,
        rngs=nnx.Rngs(params=seed, dropout=seed + 1),
        reversible=reversible,
        anchor_every=anchor_every,
        drift=drift,
    )
    # The door's state is the BatchNorm statistics (NNX keeps them in float32
    # whatever the parameters' dtype; the float64 rows want float64). The RNG
    # streams stay with the graph: each call reseeds them from its key.
    graphdef, params, stats, streams = nnx.split(model, nnx.Param, nnx.BatchStat, ...)
    stats = cast_floats(stats, dtype)
    x = jax.random.normal(jax.random.key(seed + 1), (BATCH, WIDTH), dtype)

    def apply(params, stats, x, key):
        model = nnx.merge(graphdef, params, stats, streams, copy=True)
        nnx.reseed(model, dropout=key, policy="match_shape")
        y = model(x)
        return y, nnx.state(model, nnx.BatchStat)

    return Built(params, stats, apply, x)
