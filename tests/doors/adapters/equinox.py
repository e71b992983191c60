"""The Equinox door: ``revnet.eqx.ReversibleSequence`` of a user's coupling."""

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

REQUIRES = "equinox"
pytest.importorskip(
    REQUIRES, reason="the equinox door needs equinox: pip install '.[equinox]'"
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


class Net(eqx.Module):
    """The affine coupling's net: an MLP of one example, no state."""

    mlp: eqx.nn.MLP

    def __init__(self, size, *, key, dtype):
        self.mlp = eqx.nn.MLP(size, 2 * size, WIDTH, 1, key=key, dtype=dtype)

    def __call__(self, h, *, key=None):
        return self.mlp(h)


def _coupling(dtype, exact=False):
    half = WIDTH // 2

    def make_block(key):
        kf, kg = jax.random.split(key)
        return revnet.eqx.AdditiveCoupling(
            Residual(half, key=kf, dtype=dtype),
            Residual(half, key=kg, dtype=dtype),
            exact=exact,
        )

    return make_block


def _affine(dtype):
    def make_block(key):
        return revnet.eqx.AffineCoupling(Net(WIDTH // 2, key=key, dtype=dtype))

    return make_block


class FlowStep(eqx.Module):
    """ActNorm, the 1x1 convolution and an affine coupling (Glow's step), on
    one example."""

    norm: revnet.eqx.ActNorm
    conv: revnet.eqx.InvertibleConv1x1
    coupling: revnet.eqx.AffineCoupling
    leaky: bool = eqx.field(static=True)

    def __init__(self, *, key, dtype, leaky=False):
        self.leaky = leaky
        kc, kn = jax.random.split(key)
        self.norm = revnet.eqx.ActNorm(FLOW_WIDTH, dtype=dtype)
        self.conv = revnet.eqx.InvertibleConv1x1(FLOW_WIDTH, key=kc, dtype=dtype)
        net = eqx.nn.MLP(
            FLOW_WIDTH // 2,
            FLOW_WIDTH,
            FLOW_WIDTH,
            1,
            activation=jnp.tanh,
            key=kn,
            dtype=dtype,
        )
        self.coupling = revnet.eqx.AffineCoupling(net)

    def __call__(self, h, *, key=None):
        h = self.coupling(self.conv(self.norm(h)))
        return jax.nn.leaky_relu(h, LEAK) if self.leaky else h


def build_flow(depth, *, dtype, reversible, actnorm_only=False, leaky=False, seed=0):
    def make_block(key):
        if actnorm_only:
            return revnet.eqx.ActNorm(FLOW_WIDTH, dtype=dtype)
        return FlowStep(key=key, dtype=dtype, leaky=leaky)

    x = flow_input(seed, dtype)
    seq = revnet.eqx.ReversibleSequence(
        make_block, depth, key=jax.random.key(seed), reversible=reversible
    ).initialize(x)
    params, static = eqx.partition(seq.blocks, eqx.is_inexact_array)

    def model(params):
        return eqx.tree_at(lambda s: s.blocks, seq, eqx.combine(params, static))

    def forward(params, x):
        return model(params).forward_and_log_det(x)

    def inverse(params, y):
        return model(params).inverse(y)

    return Flow(params, forward, inverse, x)


def flow_layers(dtype):
    x = layer_input(dtype)
    c = x.shape[-1]
    layers = {
        "ActNorm": revnet.eqx.ActNorm(c, dtype=dtype).initialize(x),
        "InvertibleConv1x1": revnet.eqx.InvertibleConv1x1(
            c, key=jax.random.key(0), dtype=dtype
        ),
        "Squeeze": revnet.eqx.Squeeze(),
    }
    # Equinox modules take one example: vmapped over the batch.
    return {
        n: (jax.vmap(m.forward_and_log_det), jax.vmap(m.inverse))
        for n, m in layers.items()
    }


def _built(blocks, num_layers, x, seed, **options):
    seq, state = eqx.nn.make_with_state(revnet.eqx.ReversibleSequence)(
        blocks, num_layers, key=jax.random.key(seed), **options
    )
    # The trainable leaves are the blocks' floating point arrays; the
    # sequence's own (static) options make the rest of the tree.
    params, static = eqx.partition(seq.blocks, eqx.is_inexact_array)

    def apply(params, state, x, key):
        model = eqx.tree_at(lambda s: s.blocks, seq, eqx.combine(params, static))
        return model(x, state, key=key)

    return Built(params, state, apply, x)


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
        reversible=reversible,
        anchor_every=anchor_every,
        drift=drift,
        compute_dtype=compute_dtype,
        activation_sharding=activation_sharding,
        plan=plan,
    )


def build_mixed(*, dtype, reversible, seed=0):
    blocks = [_coupling(dtype), _affine(dtype), _coupling(dtype)]
    return _built(blocks, None, example_input(seed, dtype), seed, reversible=reversible)


def build_transformer(depth, *, dtype, reversible, compute_dtype=None, seed=0):
    def make_block(key):
        return revnet.eqx.ReversibleTransformerBlock(
            MODEL, HEADS, MLP, dropout_rate=RATE, dtype=dtype, key=key
        )

    x = example_input(seed, dtype, (BATCH, TIME, MODEL))
    return _built(
        make_block, depth, x, seed, reversible=reversible, compute_dtype=compute_dtype
    )


def _seq(*args, **kwargs):
    return lambda: revnet.eqx.ReversibleSequence(*args, key=jax.random.key(0), **kwargs)


class NoKey(eqx.Module):
    linear: eqx.nn.Linear

    def __call__(self, h):
        return h + jnp.tanh(self.linear(h))


def _no_key(key):
    return NoKey(eqx.nn.Linear(WIDTH, WIDTH, key=key))


_block = _coupling(jnp.float32)
ERRORS = [
    (_seq(_block), ValueError, "num_layers must be a positive integer"),
    (_seq([_block, _block], 2), ValueError, "with a list of blocks leave out"),
    (_seq([_block, _block], anchor_every=1), ValueError, "need a single make_block"),
    (_seq(_block, 0), ValueError, "num_layers must be a positive integer"),
    (_seq(_block, 2, compute_dtype=jnp.int32), TypeError, "compute_dtype must be"),
    (
        _seq(_no_key, 2, compute_dtype=jnp.bfloat16),
        ValueError,
        "these blocks build none",
    ),
    (
        _seq(_block, 2, activation_sharding=("data",)),
        TypeError,
        "activation_sharding must be None, a jax.sharding.PartitionSpec",
    ),
    (_seq(_no_key, 2), TypeError, "must take a key= argument"),
    (
        _seq(_block(jax.random.key(0)), 2),
        TypeError,
        "make_block must build a block from a PRNG key, got an instance",
    ),
    (
        lambda: revnet.eqx.ReversibleTransformerBlock(15, 2, 32, key=jax.random.key(0)),
        ValueError,
        "model_size must be even",
    ),
]


EXACT_ERRORS = [
    (
        lambda: revnet.eqx.AffineCoupling(
            Net(WIDTH // 2, key=jax.random.key(0), dtype=jnp.float32), exact=True
        ),
        ValueError,
        re.escape("AdditiveCoupling(f, g, exact=True)"),
    ),
    (
        exact_in_bfloat16(build),
        TypeError,
        "needs a float32 or float64 stream, got bfloat16",
    ),
    (
        lambda: revnet.eqx.AdditiveCoupling(jnp.tanh, jnp.tanh, exact_bits=8),
        ValueError,
        "exact_bits=8 applies only with exact=True",
    ),
]
