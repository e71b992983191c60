"""Bad input gives a clear error naming the module and the expected shape."""

from __future__ import annotations

import re

import haiku as hk
import jax
import jax.numpy as jnp
import pytest

from revnet import blocks
from tests.blocks.descriptors import additive, mlp


def additive_coupling(x):
    return blocks.AdditiveCoupling(mlp([4, 2]), mlp([4, 2]))(x)


def affine_coupling(x):
    return blocks.AffineCoupling(mlp([4, 4]))(x)


def sequence(x):
    return blocks.ReversibleSequence(additive, 2)(x)


def revnet(x):
    return blocks.RevNet("tiny", 3)(x, True)


def transformer(x):
    return blocks.ReversibleTransformer(1, 2, 8, 8)(x, True)


def squeeze(x):
    return blocks.Squeeze()(x)


CASES = [
    # (function, input, error, words the message must contain)
    (additive_coupling, jnp.ones([2, 5]), ValueError, ["additive_coupling", "even"]),
    (additive_coupling, jnp.ones([6]), ValueError, ["additive_coupling", "rank 1"]),
    (additive_coupling, jnp.ones([2, 4], jnp.int32), TypeError, ["floating", "int32"]),
    (affine_coupling, jnp.ones([2, 3]), ValueError, ["affine_coupling", "(2, 3)"]),
    (affine_coupling, jnp.ones([2, 4], jnp.uint8), TypeError, ["affine_coupling"]),
    (sequence, jnp.ones([2, 4], jnp.int32), TypeError, ["reversible_sequence"]),
    (sequence, jnp.ones([2, 5]), ValueError, ["additive_coupling", "even"]),
    (revnet, jnp.ones([2, 8, 3]), ValueError, ["revnet", "[batch, height, width"]),
    (revnet, jnp.ones([2, 8, 8, 3], jnp.int32), TypeError, ["revnet", "floating"]),
    (transformer, jnp.ones([2, 8]), ValueError, ["transformer", "[batch, time, 8]"]),
    (transformer, jnp.ones([2, 3, 6]), ValueError, ["transformer", "(2, 3, 6)"]),
    (squeeze, jnp.ones([1, 3, 4, 2]), ValueError, ["squeeze", "divisible by 2"]),
]


@pytest.mark.parametrize(
    "fn, x, error, words",
    CASES,
    ids=[f"{c[0].__name__}-{i}" for i, c in enumerate(CASES)],
)
def test_bad_input_is_reported(fn, x, error, words):
    with pytest.raises(error) as info:
        hk.transform(fn).init(jax.random.PRNGKey(0), x)
    for word in words:
        assert word in str(info.value)


def test_residual_function_of_wrong_shape_is_reported():
    def fn(x):
        return blocks.AdditiveCoupling(mlp([4, 3]), mlp([4, 2]))(x)

    with pytest.raises(ValueError, match=re.escape("additive_coupling: f must return")):
        hk.transform(fn).init(jax.random.PRNGKey(0), jnp.ones([2, 4]))


def test_affine_net_of_wrong_width_is_reported():
    def fn(x):
        return blocks.AffineCoupling(mlp([4, 2]))(x)

    with pytest.raises(ValueError, match=r"net must return an array of shape \(2, 4\)"):
        hk.transform(fn).init(jax.random.PRNGKey(0), jnp.ones([2, 4]))


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: blocks.ReversibleTransformer(1, 3, 8, 8), ["divisible by num_heads"]),
        (lambda: blocks.RevNet("resnet50", 3), ["unknown depth_config"]),
        (lambda: blocks.AffineCoupling(mlp([2]), scale_bound=0.0), ["positive"]),
        (lambda: blocks.ChannelPermutation("sorted"), ["kind"]),
    ],
    ids=["heads", "config", "scale_bound", "permutation"],
)
def test_bad_configuration_is_reported(make, words):
    with pytest.raises(ValueError) as info:
        hk.transform(lambda: make()).init(None)
    for word in words:
        assert word in str(info.value)


def test_stage_transition_is_not_invertible():
    def fn(x):
        return blocks.StageTransition(4).inverse(x)

    with pytest.raises(NotImplementedError, match="not invertible"):
        hk.transform(fn).init(None, jnp.ones([1, 2, 2, 4]))
