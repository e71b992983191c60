"""The Flax NNX door: ``revnet.nnx.ReversibleSequence`` of a user's coupling.

The model is built the NNX way (``nnx.Module``\\ s created with ``nnx.Rngs``)
and exposed functionally through ``nnx.split``/``nnx.merge``. The door's
dropout ``key`` reseeds the blocks' ``dropout`` streams (``nnx.reseed``, one
key per layer), so the same key gives the same masks, as in the other doors.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from tests.doors.adapters import (
    BATCH,
    FLOW_WIDTH,
    HEADS,
    LEAK,
    MLP,
    MODEL,
    RATE,
    TIME,
    WIDTH,
    Built,
    Flow,
    exact_in_bfloat16,
    example_input,
    flow_input,
    layer_input,
)
from tests.helpers import cast_floats

REQUIRES = "flax"
pytest.importorskip(REQUIRES, reason="the nnx door needs flax: pip install '.[nnx]'")

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


def _coupling(dtype, exact=False):
    half = WIDTH // 2

    def block(rngs):
        return revnet.nnx.AdditiveCoupling(
            Residual(half, dtype=dtype, rngs=rngs),
            Residual(half, dtype=dtype, rngs=rngs),
            exact=exact,
        )

    return block


def _affine(dtype):
    def block(rngs):
        net = nnx.Sequential(
            nnx.Linear(WIDTH // 2, WIDTH, param_dtype=dtype, rngs=rngs),
            jnp.tanh,
            nnx.Linear(WIDTH, WIDTH, param_dtype=dtype, rngs=rngs),
        )
        return revnet.nnx.AffineCoupling(net)

    return block


class FlowStep(nnx.Module):
    """ActNorm, the 1x1 convolution and an affine coupling (Glow's step)."""

    def __init__(self, *, dtype, rngs, leaky=False):
        self.leaky = leaky
        self.norm = revnet.nnx.ActNorm(FLOW_WIDTH, param_dtype=dtype)
        self.conv = revnet.nnx.InvertibleConv1x1(
            FLOW_WIDTH, param_dtype=dtype, rngs=rngs
        )
        net = nnx.Sequential(
            nnx.Linear(FLOW_WIDTH // 2, FLOW_WIDTH, param_dtype=dtype, rngs=rngs),
            jnp.tanh,
            nnx.Linear(FLOW_WIDTH, FLOW_WIDTH, param_dtype=dtype, rngs=rngs),
        )
        self.coupling = revnet.nnx.AffineCoupling(net)

    def __call__(self, h):
        h = self.coupling(self.conv(self.norm(h)))
        return jax.nn.leaky_relu(h, LEAK) if self.leaky else h


def build_flow(depth, *, dtype, reversible, actnorm_only=False, leaky=False, seed=0):
    def block(rngs):
        if actnorm_only:
            return revnet.nnx.ActNorm(FLOW_WIDTH, param_dtype=dtype)
        return FlowStep(dtype=dtype, rngs=rngs, leaky=leaky)

    model = revnet.nnx.ReversibleSequence(
        block, depth, rngs=nnx.Rngs(seed), reversible=reversible
    )
    x = flow_input(seed, dtype)
    model.initialize(x)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def forward(params, x):
        return nnx.merge(graphdef, params, rest, copy=True).forward_and_log_det(x)

    def inverse(params, y):
        return nnx.merge(graphdef, params, rest, copy=True).inverse(y)

    return Flow(params, forward, inverse, x)


def flow_layers(dtype):
    x = layer_input(dtype)
    c = x.shape[-1]
    norm = revnet.nnx.ActNorm(c, param_dtype=dtype)
    norm.initialize(x)
    conv = revnet.nnx.InvertibleConv1x1(c, param_dtype=dtype, rngs=nnx.Rngs(0))
    layers = {
        "ActNorm": norm,
        "InvertibleConv1x1": conv,
        "Squeeze": revnet.nnx.Squeeze(),
    }
    return {n: (m.forward_and_log_det, m.inverse) for n, m in layers.items()}


def _built(blocks, num_layers, x, seed, dtype, **options):
    model = revnet.nnx.ReversibleSequence(
        blocks, num_layers, rngs=nnx.Rngs(params=seed, dropout=seed + 1), **options
    )
    # The door's state is the BatchNorm statistics (NNX keeps them in float32
    # whatever the parameters' dtype; the float64 rows want float64). The RNG
    # streams stay with the graph: each call reseeds them from its key.
    graphdef, params, stats, streams = nnx.split(model, nnx.Param, nnx.BatchStat, ...)
    stats = cast_floats(stats, dtype)

    def apply(params, stats, x, key):
        model = nnx.merge(graphdef, params, stats, streams, copy=True)
        nnx.reseed(model, dropout=key, policy="match_shape")
        y = model(x)
        return y, nnx.state(model, nnx.BatchStat)

    return Built(params, stats, apply, x)


def build(
    depth,
    *,
    dtype,
    reversible,
    anchor_every=None,
    drift=None,
    seed=0,
    compute_dtype=None,
    activation_sharding=None,
    exact=False,
    plan=None,
):
    return _built(
        _coupling(dtype, exact),
        depth,
        example_input(seed, dtype),
        seed,
        dtype,
        reversible=reversible,
        anchor_every=anchor_every,
        drift=drift,
        compute_dtype=compute_dtype,
        activation_sharding=activation_sharding,
        plan=plan,
    )


def build_mixed(*, dtype, reversible, seed=0):
    blocks = [_coupling(dtype), _affine(dtype), _coupling(dtype)]
    return _built(
        blocks, None, example_input(seed, dtype), seed, dtype, reversible=reversible
    )


def build_transformer(depth, *, dtype, reversible, compute_dtype=None, seed=0):
    def block(rngs):
        return revnet.nnx.ReversibleTransformerBlock(
            MODEL,
            HEADS,
            MLP,
            dropout_rate=RATE,
            param_dtype=dtype,
            rngs=rngs,
        )

    x = example_input(seed, dtype, (BATCH, TIME, MODEL))
    return _built(
        block, depth, x, seed, dtype, reversible=reversible, compute_dtype=compute_dtype
    )


def _seq(*args, **kwargs):
    return lambda: revnet.nnx.ReversibleSequence(*args, rngs=nnx.Rngs(0), **kwargs)


def _plain(rngs):
    return nnx.Linear(WIDTH, WIDTH, rngs=rngs)


_block = _coupling(jnp.float32)
ERRORS = [
    (_seq(_block), ValueError, "num_layers must be a positive integer"),
    (_seq([_block, _block], 2), ValueError, "with a list of blocks leave out"),
    (_seq([_block, _block], anchor_every=1), ValueError, "need a single block"),
    (_seq(_block, 0), ValueError, "num_layers must be a positive integer"),
    (_seq(_block, 2, compute_dtype=jnp.int32), TypeError, "compute_dtype must be"),
    (
        _seq(_plain, 2, compute_dtype=jnp.bfloat16),
        ValueError,
        "these blocks build none",
    ),
    (
        _seq(_block, 2, activation_sharding=("data",)),
        TypeError,
        "activation_sharding must be None, a jax.sharding.PartitionSpec",
    ),
    (
        _seq(_plain(nnx.Rngs(0)), 2),
        TypeError,
        "block must create a block, got an instance of Linear",
    ),
    (
        lambda: revnet.nnx.ReversibleTransformerBlock(15, 2, 32, rngs=nnx.Rngs(0)),
        ValueError,
        "model_size must be even",
    ),
]


def _net(rngs):
    return nnx.Linear(WIDTH // 2, WIDTH, rngs=rngs)


EXACT_ERRORS = [
    (
        lambda: revnet.nnx.AffineCoupling(_net(nnx.Rngs(0)), exact=True),
        ValueError,
        re.escape("AdditiveCoupling(f, g, exact=True)"),
    ),
    (
        exact_in_bfloat16(build),
        TypeError,
        "needs a float32 or float64 stream, got bfloat16",
    ),
    (
        lambda: revnet.nnx.AdditiveCoupling(jnp.tanh, jnp.tanh, exact_bits=8),
        ValueError,
        "exact_bits=8 applies only with exact=True",
    ),
]
