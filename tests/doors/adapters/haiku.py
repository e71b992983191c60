"""The Haiku door: ``revnet.blocks.ReversibleSequence`` of a user's coupling."""

from __future__ import annotations

import functools
import re

import haiku as hk
import jax
import jax.numpy as jnp

from revnet import blocks
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

REQUIRES = None


def residual(h):
    u = hk.Linear(h.shape[-1])(h)
    u = hk.BatchNorm(True, True, decay_rate=0.9)(u, is_training=True)
    return hk.dropout(hk.next_rng_key(), RATE, jnp.tanh(u))


def block(x, *, exact=False):
    return blocks.AdditiveCoupling(residual, residual, exact=exact)(x)


def affine(x):
    return blocks.AffineCoupling(hk.nets.MLP([WIDTH, WIDTH]))(x)


def flow_step(h, leaky=False):
    h = blocks.ActNorm()(h)
    h = blocks.InvertibleConv1x1()(h)
    net = hk.nets.MLP([FLOW_WIDTH, FLOW_WIDTH], activation=jnp.tanh)
    h = blocks.AffineCoupling(net, zero_init=False)(h)
    return jax.nn.leaky_relu(h, LEAK) if leaky else h


def build_flow(depth, *, dtype, reversible, actnorm_only=False, leaky=False, seed=0):
    step = functools.partial(flow_step, leaky=leaky)
    if actnorm_only:
        step = lambda h: blocks.ActNorm()(h)  # noqa: E731

    def seq():
        return blocks.ReversibleSequence(step, depth, reversible=reversible)

    forward = hk.transform(lambda x: seq().forward_and_log_det(x))
    inverse = hk.transform(lambda y: seq().inverse(y))
    x = flow_input(seed, dtype)
    params = forward.init(jax.random.PRNGKey(seed), x)
    return Flow(
        params,
        lambda p, x: forward.apply(p, None, x),
        lambda p, y: inverse.apply(p, None, y),
        x,
    )


def flow_layers(dtype):
    x = layer_input(dtype)
    layers = {}
    for name, make in [
        ("ActNorm", blocks.ActNorm),
        ("InvertibleConv1x1", blocks.InvertibleConv1x1),
        ("Squeeze", blocks.Squeeze),
        ("ChannelPermutation", blocks.ChannelPermutation),
    ]:
        fwd = hk.transform(lambda x, make=make: make().forward_and_log_det(x))
        inv = hk.transform(lambda y, make=make: make().inverse(y))
        params = fwd.init(jax.random.PRNGKey(0), x)
        layers[name] = (
            lambda x, f=fwd, p=params: f.apply(p, None, x),
            lambda y, f=inv, p=params: f.apply(p, None, y),
        )
    return layers


def _built(model, x, seed):
    net = hk.transform_with_state(model)
    params, state = net.init(jax.random.PRNGKey(seed), x)

    def apply(params, state, x, key):
        return net.apply(params, state, key, x)

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
    def model(x):
        seq = blocks.ReversibleSequence(
            functools.partial(block, exact=exact),
            depth,
            reversible=reversible,
            anchor_every=anchor_every,
            drift=drift,
            compute_dtype=compute_dtype,
            activation_sharding=activation_sharding,
            plan=plan,
        )
        return seq(x)

    return _built(model, example_input(seed, dtype), seed)


def build_mixed(*, dtype, reversible, seed=0):
    def model(x):
        return blocks.ReversibleSequence([block, affine, block], reversible=reversible)(
            x
        )

    return _built(model, example_input(seed, dtype), seed)


def build_transformer(depth, *, dtype, reversible, compute_dtype=None, seed=0):
    def model(x):
        encoder = blocks.ReversibleTransformer(
            depth,
            HEADS,
            MODEL,
            MLP,
            dropout_rate=RATE,
            reversible=reversible,
            compute_dtype=compute_dtype,
        )
        return encoder(x, True)

    return _built(model, example_input(seed, dtype, (BATCH, TIME, MODEL)), seed)


def _made(make):
    """A row's thunk: ``make()`` run inside a transform, as Haiku modules are."""

    def thunk():
        def fn(x):
            module = make()
            return module(x) if callable(module) else x

        hk.transform(fn).init(jax.random.PRNGKey(0), jnp.ones((BATCH, WIDTH)))

    return thunk


def _seq(*args, **kwargs):
    return _made(lambda: blocks.ReversibleSequence(*args, **kwargs))


ERRORS = [
    (_seq(block), ValueError, "num_layers must be a positive integer"),
    (_seq([block, block], 2), ValueError, "with a list of blocks leave out"),
    (_seq([block, block], anchor_every=1), ValueError, "need a single block_fn"),
    (_seq(block, 0), ValueError, "num_layers must be a positive integer"),
    (_seq(block, 2, compute_dtype=jnp.int32), TypeError, "compute_dtype must be"),
    (
        _seq(lambda h: 2.0 * h + 1.0, 2, compute_dtype=jnp.bfloat16),
        ValueError,
        "these blocks build none",
    ),
    (
        _seq(block, 2, activation_sharding=("data",)),
        TypeError,
        "activation_sharding must be None, a jax.sharding.PartitionSpec",
    ),
    (
        _made(lambda: blocks.ReversibleTransformer(2, 2, 15, 32)),
        ValueError,
        "model_size must be even",
    ),
]


EXACT_ERRORS = [
    (
        _made(lambda: blocks.AffineCoupling(hk.nets.MLP([WIDTH]), exact=True)),
        ValueError,
        re.escape("AdditiveCoupling(f, g, exact=True)"),
    ),
    (
        exact_in_bfloat16(build),
        TypeError,
        "needs a float32 or float64 stream, got bfloat16",
    ),
    (
        _made(lambda: blocks.AdditiveCoupling(residual, residual, exact_bits=8)),
        ValueError,
        "exact_bits=8 applies only with exact=True",
    ),
]
