"""One entry per block module, in the spirit of Haiku's integration descriptors.

Every entry builds its module (inside a transform) from a ``reversible`` flag,
says how to call it and how to check a round trip through its inverse. The
generic checks in ``test_descriptors.py`` run over all entries.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp

from revnet import blocks
from revnet.blocks.revnet import residual_function


class Entry(NamedTuple):
    """A module under test.

    Attributes:
      name: Test id.
      make: ``make(reversible) -> module``; ``reversible`` is ignored by modules
        without a twin.
      shape: Input shape.
      training: Whether the module is called with ``is_training=True``.
      has_twin: Whether ``make(False)`` is an ordinary-backprop twin.
    """

    name: str
    make: Callable[[bool], hk.Module]
    shape: tuple[int, ...]
    training: bool = False
    has_twin: bool = True

    def call(self, module: hk.Module, x: jax.Array) -> jax.Array:
        return module(x, True) if self.training else module(x)

    def inverse(self, module: hk.Module, y: jax.Array) -> jax.Array:
        if isinstance(module, blocks.RevNet):
            # A RevNet inverts back to the input of its last reversible stage; run
            # that stage again to close the loop.
            rebuilt = module.inverse(y, True)
            return module.stages[-1](rebuilt, is_training=True)
        return module.inverse(y, True) if self.training else module.inverse(y)

    def forward(self, module: hk.Module, x: jax.Array) -> jax.Array:
        """The invertible part of the module (a RevNet's features)."""
        if isinstance(module, blocks.RevNet):
            return module.features(x, True)
        return self.call(module, x)

    def round_trip_target(self, x: jax.Array, y: jax.Array) -> jax.Array:
        return y if self.name.startswith("revnet") else x


def mlp(sizes: list[int]) -> Callable[[jax.Array], jax.Array]:
    return lambda h: hk.nets.MLP(sizes, activation=jnp.tanh)(h)


def additive(h: jax.Array) -> jax.Array:
    width = h.shape[-1] // 2
    return blocks.AdditiveCoupling(mlp([16, width]), mlp([16, width]))(h)


def affine(h: jax.Array) -> jax.Array:
    # Random output layers: at zero initialisation every block is the identity.
    return blocks.AffineCoupling(mlp([16, h.shape[-1]]), zero_init=False)(h)


def permuted_affine(h: jax.Array) -> jax.Array:
    return blocks.ChannelPermutation()(affine(h))


def conv_unit(h: jax.Array, is_training: bool) -> jax.Array:
    f = functools.partial(residual_function, is_training=is_training)
    return blocks.AdditiveCoupling(f, f)(h)


REVNET_ONE_STAGE = blocks.RevNetConfig(units=(2,), channels=(4, 8))

ENTRIES = [
    Entry(
        "additive_stack",
        lambda rev: blocks.ReversibleSequence(additive, 8, reversible=rev),
        (4, 8),
    ),
    Entry(
        "affine_stack",
        lambda rev: blocks.ReversibleSequence(affine, 8, reversible=rev),
        (4, 8),
    ),
    Entry(
        "heterogeneous_chain",
        lambda rev: blocks.ReversibleSequence(
            [additive, permuted_affine, additive], reversible=rev
        ),
        (4, 8),
    ),
    Entry(
        "conv_batchnorm_stack",
        lambda rev: blocks.ReversibleSequence(conv_unit, 3, reversible=rev),
        (2, 4, 4, 8),
        training=True,
    ),
    Entry(
        "revnet_tiny",
        # One stage behind a (non-reversible) transition, to keep compiles short.
        lambda rev: blocks.RevNet(REVNET_ONE_STAGE, 5, reversible=rev),
        (2, 8, 8, 3),
        training=True,
    ),
    Entry(
        "transformer",
        lambda rev: blocks.ReversibleTransformer(
            2, 2, 8, 16, dropout_rate=0.2, reversible=rev
        ),
        (2, 5, 8),
        training=True,
    ),
    Entry(
        "revnet_tiny_anchored",
        lambda rev: blocks.RevNet(REVNET_ONE_STAGE, 5, reversible=rev, anchor_every=1),
        (2, 8, 8, 3),
        training=True,
    ),
    Entry(
        "transformer_anchored",
        lambda rev: blocks.ReversibleTransformer(
            3, 2, 8, 16, dropout_rate=0.2, reversible=rev, anchor_every=2
        ),
        (2, 5, 8),
        training=True,
    ),
    Entry("additive_coupling_alone", lambda rev: _coupling(), (3, 2, 6), False, False),
    Entry(
        "affine_coupling_alone",
        lambda rev: blocks.AffineCoupling(mlp([8, 6]), zero_init=False),
        (3, 6),
        has_twin=False,
    ),
    Entry("squeeze", lambda rev: blocks.Squeeze(), (2, 4, 4, 3), has_twin=False),
    Entry("act_norm", lambda rev: blocks.ActNorm(), (3, 2, 2, 4), has_twin=False),
    Entry(
        "invertible_conv1x1",
        lambda rev: blocks.InvertibleConv1x1(),
        (3, 2, 2, 4),
        has_twin=False,
    ),
    Entry(
        "permutation",
        lambda rev: blocks.ChannelPermutation(),
        (3, 7),
        has_twin=False,
    ),
]


def _coupling() -> hk.Module:
    return blocks.AdditiveCoupling(mlp([8, 3]), mlp([8, 3]))


# Exported names that have no entry above, each with the reason. A name
# exported from ``revnet.blocks`` without an entry or a reason fails
# ``test_descriptors.py::test_every_exported_module_is_described``.
EXCUSED = {
    "REVNET_RULES": "partition rules for RevNet (tests/sharding/test_mesh.py), not a "
    "module",
    "TRANSFORMER_RULES": "partition rules for ReversibleTransformer "
    "(tests/sharding/test_mesh.py), not a module",
    "constrain": "a sharding constraint for the current mesh mode "
    "(tests/sharding/test_mesh.py), not a module",
    "partition": "parameter shardings from rules (tests/sharding/test_mesh.py), not a "
    "module",
    "CONFIGS": "a dict of RevNet configurations, not a module",
    "RevNetConfig": "a named tuple of RevNet hyperparameters, not a module",
    "StageTransition": (
        "not invertible by design (a strided convolution); it runs inside the "
        "revnet_tiny entry and its refusal is tested in test_errors.py"
    ),
}


def described_types() -> set[type]:
    """The module classes the entries construct at their top level."""
    types = set()
    for entry in ENTRIES:
        hk.transform(lambda: types.add(type(entry.make(True)))).init(None)
    return types
