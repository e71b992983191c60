"""Bad input gives a clear error naming the module and the expected shape."""

from __future__ import annotations

import re

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revnet import blocks
from tests.doors.haiku.descriptors import additive, mlp


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


# --------------------------------------------------------------------------- #
# Constructor arguments are checked up front: a one-line error that names the
# module, the argument, the value and what was expected.

_F = mlp([2])
_TINY = blocks.RevNetConfig((1,), (4, 4))


def _seq(**kw):
    return blocks.ReversibleSequence(**{"block_fn": additive, "num_layers": 2, **kw})


def _transformer(**kw):
    return blocks.ReversibleTransformer(
        **{**dict(num_layers=1, num_heads=2, model_size=8, mlp_size=8), **kw}
    )


# (module name, make, error, argument, shown value, expected words)
ARGUMENT_CASES = [
    (
        "reversible_sequence",
        lambda: _seq(num_layers=1.5),
        TypeError,
        "num_layers",
        "1.5",
        "integer",
    ),
    (
        "reversible_sequence",
        lambda: _seq(num_layers="3"),
        TypeError,
        "num_layers",
        "'3'",
        "integer",
    ),
    (
        "reversible_sequence",
        lambda: _seq(num_layers=True),
        TypeError,
        "num_layers",
        "True",
        "integer",
    ),
    (
        "reversible_sequence",
        lambda: _seq(num_layers=-2),
        ValueError,
        "num_layers",
        "-2",
        "positive",
    ),
    (
        "reversible_sequence",
        lambda: _seq(anchor_every=0),
        ValueError,
        "anchor_every",
        "0",
        "positive",
    ),
    (
        "reversible_sequence",
        lambda: _seq(anchor_every=-4),
        ValueError,
        "anchor_every",
        "-4",
        "positive",
    ),
    (
        "reversible_sequence",
        lambda: _seq(anchor_every=2.0),
        TypeError,
        "anchor_every",
        "2.0",
        "integer",
    ),
    (
        "reversible_sequence",
        lambda: _seq(anchor_every=True),
        TypeError,
        "anchor_every",
        "True",
        "integer",
    ),
    (
        "reversible_sequence",
        lambda: _seq(drift="monitor"),
        TypeError,
        "drift",
        "'monitor'",
        "revnet.DriftMonitor",
    ),
    (
        "reversible_sequence",
        lambda: _seq(reversible="no"),
        TypeError,
        "reversible",
        "'no'",
        "bool",
    ),
    (
        "reversible_sequence",
        lambda: _seq(block_fn=3),
        TypeError,
        "block_fn",
        "3",
        "callable",
    ),
    (
        "reversible_sequence",
        lambda: _seq(block_fn="additive", num_layers=None),
        TypeError,
        "block_fn",
        "'additive'",
        "callable",
    ),
    (
        "reversible_sequence",
        lambda: _seq(block_fn=[additive, 3], num_layers=None),
        TypeError,
        "block_fn[1]",
        "3",
        "callable",
    ),
    (
        "additive_coupling",
        lambda: blocks.AdditiveCoupling(3, _F),
        TypeError,
        "f",
        "3",
        "callable",
    ),
    (
        "additive_coupling",
        lambda: blocks.AdditiveCoupling(_F, None),
        TypeError,
        "g",
        "None",
        "callable",
    ),
    (
        "additive_coupling",
        lambda: blocks.AdditiveCoupling(_F, _F, "int8"),
        TypeError,
        "compute_dtype",
        "'int8'",
        "floating point dtype",
    ),
    (
        "additive_coupling",
        lambda: blocks.AdditiveCoupling(_F, _F, "nonsense"),
        TypeError,
        "compute_dtype",
        "'nonsense'",
        "floating point dtype",
    ),
    (
        "affine_coupling",
        lambda: blocks.AffineCoupling("net"),
        TypeError,
        "net",
        "'net'",
        "callable",
    ),
    (
        "affine_coupling",
        lambda: blocks.AffineCoupling(_F, scale_bound="2"),
        TypeError,
        "scale_bound",
        "'2'",
        "positive",
    ),
    (
        "affine_coupling",
        lambda: blocks.AffineCoupling(_F, scale_bound=True),
        TypeError,
        "scale_bound",
        "True",
        "positive",
    ),
    (
        "affine_coupling",
        lambda: blocks.AffineCoupling(_F, scale_bound=float("inf")),
        ValueError,
        "scale_bound",
        "inf",
        "finite",
    ),
    (
        "affine_coupling",
        lambda: blocks.AffineCoupling(_F, scale="softplus"),
        ValueError,
        "scale",
        "'softplus'",
        "one of 'sigmoid', 'tanh', 'exp'",
    ),
    (
        "affine_coupling",
        lambda: blocks.AffineCoupling(_F, scale=2.0),
        TypeError,
        "scale",
        "2.0",
        "'sigmoid'",
    ),
    (
        "affine_coupling",
        lambda: blocks.AffineCoupling(_F, scale_bound=2.0),
        ValueError,
        "scale_bound",
        "2.0 with scale='sigmoid'",
        "unless scale='tanh'",
    ),
    (
        "affine_coupling",
        lambda: blocks.AffineCoupling(_F, zero_init=1),
        TypeError,
        "zero_init",
        "1",
        "bool",
    ),
    (
        "affine_coupling",
        lambda: blocks.AffineCoupling(_F, compute_dtype=1.5),
        TypeError,
        "compute_dtype",
        "1.5",
        "dtype",
    ),
    ("squeeze", lambda: blocks.Squeeze(2.0), TypeError, "factor", "2.0", "integer"),
    ("squeeze", lambda: blocks.Squeeze(0), ValueError, "factor", "0", "positive"),
    ("squeeze", lambda: blocks.Squeeze(True), TypeError, "factor", "True", "integer"),
    (
        "channel_permutation",
        lambda: blocks.ChannelPermutation(3),
        TypeError,
        "kind",
        "3",
        "'random' or 'reverse'",
    ),
    (
        "channel_permutation",
        lambda: blocks.ChannelPermutation(seed=1.0),
        TypeError,
        "seed",
        "1.0",
        "integer",
    ),
    (
        "channel_permutation",
        lambda: blocks.ChannelPermutation(seed=-1),
        ValueError,
        "seed",
        "-1",
        "non-negative",
    ),
    (
        "channel_permutation",
        lambda: blocks.ChannelPermutation(seed=2**32),
        ValueError,
        "seed",
        str(2**32),
        "below 2**32",
    ),
    (
        "stage_transition",
        lambda: blocks.StageTransition(8.0),
        TypeError,
        "output_channels",
        "8.0",
        "integer",
    ),
    (
        "stage_transition",
        lambda: blocks.StageTransition(8, stride="2"),
        TypeError,
        "stride",
        "'2'",
        "integer",
    ),
    (
        "stage_transition",
        lambda: blocks.StageTransition(8, stride=0),
        ValueError,
        "stride",
        "0",
        "positive",
    ),
    (
        "stage_transition",
        lambda: blocks.StageTransition(8, bottleneck=1),
        TypeError,
        "bottleneck",
        "1",
        "bool",
    ),
    (
        "stage_transition",
        lambda: blocks.StageTransition(8, bn_config=[1]),
        TypeError,
        "bn_config",
        "[1]",
        "dict",
    ),
    (
        "stage_transition",
        lambda: blocks.StageTransition(2, bottleneck=True),
        ValueError,
        "output_channels",
        "2",
        "at least 4",
    ),
    (
        "revnet",
        lambda: blocks.RevNet(_TINY, 10.0),
        TypeError,
        "num_classes",
        "10.0",
        "integer",
    ),
    (
        "revnet",
        lambda: blocks.RevNet(_TINY, True),
        TypeError,
        "num_classes",
        "True",
        "integer",
    ),
    (
        "revnet",
        lambda: blocks.RevNet(_TINY, 0),
        ValueError,
        "num_classes",
        "0",
        "positive",
    ),
    (
        "revnet",
        lambda: blocks.RevNet(38, 10),
        TypeError,
        "depth_config",
        "38",
        "RevNetConfig",
    ),
    (
        "revnet",
        lambda: blocks.RevNet(blocks.RevNetConfig((1.5,), (4, 4)), 10),
        TypeError,
        "depth_config.units[0]",
        "1.5",
        "integer",
    ),
    (
        "revnet",
        lambda: blocks.RevNet(blocks.RevNetConfig((0,), (4, 4)), 10),
        ValueError,
        "depth_config.units[0]",
        "0",
        "positive",
    ),
    (
        "revnet",
        lambda: blocks.RevNet(blocks.RevNetConfig((1,), (4, "4")), 10),
        TypeError,
        "depth_config.channels[1]",
        "'4'",
        "integer",
    ),
    (
        "revnet",
        lambda: blocks.RevNet(blocks.RevNetConfig((1,), (4, 4), "yes"), 10),
        TypeError,
        "depth_config.bottleneck",
        "'yes'",
        "bool",
    ),
    (
        "revnet",
        lambda: blocks.RevNet(_TINY, 10, reversible=None),
        TypeError,
        "reversible",
        "None",
        "bool",
    ),
    (
        "revnet",
        lambda: blocks.RevNet(_TINY, 10, compute_dtype="int32"),
        TypeError,
        "compute_dtype",
        "'int32'",
        "floating point",
    ),
    (
        "reversible_transformer",
        lambda: _transformer(num_layers=2.0),
        TypeError,
        "num_layers",
        "2.0",
        "integer",
    ),
    (
        "reversible_transformer",
        lambda: _transformer(num_heads="2"),
        TypeError,
        "num_heads",
        "'2'",
        "integer",
    ),
    (
        "reversible_transformer",
        lambda: _transformer(num_heads=0),
        ValueError,
        "num_heads",
        "0",
        "positive",
    ),
    (
        "reversible_transformer",
        lambda: _transformer(model_size=8.0),
        TypeError,
        "model_size",
        "8.0",
        "integer",
    ),
    (
        "reversible_transformer",
        lambda: _transformer(mlp_size=False),
        TypeError,
        "mlp_size",
        "False",
        "integer",
    ),
    (
        "reversible_transformer",
        lambda: _transformer(dropout_rate=1.0),
        ValueError,
        "dropout_rate",
        "1.0",
        "[0, 1)",
    ),
    (
        "reversible_transformer",
        lambda: _transformer(dropout_rate="0.1"),
        TypeError,
        "dropout_rate",
        "'0.1'",
        "[0, 1)",
    ),
    (
        "reversible_transformer",
        lambda: _transformer(reversible=1),
        TypeError,
        "reversible",
        "1",
        "bool",
    ),
    (
        "reversible_sequence",
        lambda: _seq(kinks="never"),
        ValueError,
        "kinks",
        "'never'",
        "one of ('recompute', 'store')",
    ),
    (
        "revnet",
        lambda: blocks.RevNet(_TINY, 10, decisions="sometimes"),
        ValueError,
        "decisions",
        "'sometimes'",
        "one of ('store', 'recompute')",
    ),
    (
        "reversible_transformer",
        lambda: _transformer(kinks=None),
        ValueError,
        "kinks",
        "None",
        "one of ('recompute', 'store')",
    ),
]


@pytest.mark.parametrize(
    "module, make, error, arg, shown, expected",
    ARGUMENT_CASES,
    ids=[f"{c[0]}-{c[3]}-{c[4]}" for c in ARGUMENT_CASES],
)
def test_bad_constructor_argument_is_reported(
    module, make, error, arg, shown, expected
):
    with pytest.raises(error) as info:
        hk.transform(lambda: make()).init(None)
    message = str(info.value)
    assert "\n" not in message, message
    assert message.startswith(f"{module}: {arg} must be "), message
    assert f"got {shown}" in message and expected in message, message


@pytest.mark.parametrize(
    "make",
    [
        lambda: blocks.AdditiveCoupling(_F, _F, name=3),
        lambda: _seq(name=3),
        lambda: blocks.RevNet("tiny", 10, name=3),
    ],
    ids=["coupling", "sequence", "revnet"],
)
def test_bad_module_name_is_reported(make):
    # The module has no name yet: the message names its class.
    with pytest.raises(TypeError, match=r"^\w+: name must be a string or None, got 3$"):
        hk.transform(lambda: make()).init(None)


def test_numpy_arguments_are_accepted():
    def fn(x):
        seq = blocks.ReversibleSequence(
            additive, np.int64(2), reversible=np.bool_(True)
        )
        return blocks.ChannelPermutation(seed=np.uint32(7))(
            blocks.AffineCoupling(
                mlp([4, 4]),
                scale="tanh",
                scale_bound=np.float32(1.5),
                compute_dtype="float32",
            )(seq(x))
        )

    x = jnp.ones([2, 4])
    model = hk.transform(fn)
    params = model.init(jax.random.PRNGKey(0), x)
    assert model.apply(params, None, x).shape == (2, 4)


def _one_device_mesh():
    return jax.make_mesh((1, 1), ("data", "model"))


def _block(x):
    a, b = jnp.split(x, 2, -1)
    return jnp.concatenate([a + jnp.tanh(hk.Linear(4, name="lin")(b)), b], -1)


def test_partition_refuses_a_spec_shorter_than_one_layers_parameter():
    # A stacked kernel w: [layers, in, out] named by one entry would be placed
    # as P(None, None, "model"), on the wrong dimension: refused, naming its path.
    def net(x):
        return blocks.ReversibleSequence(_block, num_layers=3, name="net")(x)

    params = hk.transform(net).init(jax.random.key(0), jnp.ones((2, 8)))
    mesh = _one_device_mesh()
    with pytest.raises(ValueError) as err:
        blocks.partition(params, mesh, ((r"lin/w$", ("model",)), (".*", ())))
    message = str(err.value)
    assert (
        "'net/~/layers/lin/w'" in message and "fewer than the 2 dimensions" in message
    )
    assert "\n" not in message
    # One layer's full spec gets the layer axis in front; nested sequences two.
    got = blocks.partition(params, mesh, ((r"lin/w$", ("data", "model")), (".*", ())))
    assert got["net/~/layers/lin"]["w"].spec == jax.sharding.PartitionSpec(
        None, "data", "model"
    )

    def nested(x):
        inner = lambda h: blocks.ReversibleSequence(_block, 2, name="inner")(h)  # noqa: E731
        return blocks.ReversibleSequence(inner, num_layers=3, name="outer")(x)

    params = hk.transform(nested).init(jax.random.key(0), jnp.ones((2, 8)))
    got = blocks.partition(params, mesh, ((r"lin/b$", ("model",)), (".*", ())))
    leaf = got["outer/~/layers/inner/~/layers/lin"]
    assert leaf["b"].spec == jax.sharding.PartitionSpec(None, None, "model")


@pytest.mark.parametrize("model", ["transformer", "revnet"])
def test_partition_accepts_the_built_in_rules_on_their_models(model):
    if model == "transformer":
        rules = blocks.TRANSFORMER_RULES

        def net(x):
            return blocks.ReversibleTransformer(2, 2, 8, 16)(x, True)

        x = jnp.ones((2, 4, 8))
    else:
        rules = blocks.REVNET_RULES

        def net(x):
            return blocks.RevNet("revnet38", 10)(x, True)

        x = jnp.ones((1, 8, 8, 3))
    params = jax.eval_shape(hk.transform_with_state(net).init, jax.random.key(0), x)[0]
    axes = {"embed": "data", "heads": "model", "mlp": "model", "conv_out": "model"}
    shardings = blocks.partition(params, _one_device_mesh(), rules, axes=axes)
    assert any("model" in str(s.spec) for s in jax.tree.leaves(shardings))
