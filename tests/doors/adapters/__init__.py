"""The front doors of the cross-door table (tests/doors/test_table.py).

Each door is a module ``tests/doors/adapters/<name>.py`` written the way a user of its
framework would write it, through revnet's public front door, with:

* ``REQUIRES``: None, or the package the door needs; a door whose package is
  missing skips (``pytest.importorskip`` at its top, the reason naming the
  extra to install);
* ``build(depth, *, dtype, reversible, anchor_every=None, drift=None, seed=0)
  -> Built``: a stack of ``depth`` of the framework's own additive-coupling
  blocks whose residual functions F and G each hold a BatchNorm (train mode,
  batch statistics) and dropout (rate :data:`RATE`), on an input ``x`` of
  shape ``[BATCH, WIDTH]``. The same ``seed`` gives the same parameters,
  reversible or not. It also takes the sequence's ``compute_dtype`` and
  ``activation_sharding``, ``exact`` (the couplings' ``exact=True``) and
  ``plan`` (a ``revnet.StackPlan``);
* ``build_mixed(*, dtype, reversible, seed=0) -> Built``: a list of
  different blocks (that coupling, an affine coupling, that coupling again);
* ``build_transformer(depth, *, dtype, reversible, compute_dtype=None,
  seed=0) -> Built``: the door's reversible transformer blocks (dropout rate
  :data:`RATE`) on ``x`` of shape ``[BATCH, TIME, MODEL]``;
* ``build_flow(depth, *, dtype, reversible, actnorm_only=False, leaky=False,
  seed=0) -> Flow``: a Glow stack of the door's ``ActNorm``,
  ``InvertibleConv1x1`` and ``AffineCoupling`` (or of ActNorms alone; with
  ``leaky``, each step ends with ``jax.nn.leaky_relu(h, LEAK)``, a decision
  the plan stores per layer), initialised from data on ``x`` of shape
  ``[FLOW_BATCH, FLOW_WIDTH]`` (:func:`flow_input`);
* ``flow_layers(dtype) -> {name: (forward, inverse)}``: the door's
  ``ActNorm`` (initialised from :func:`layer_input`), ``InvertibleConv1x1``
  and ``Squeeze`` alone, ``forward(x) -> (y, log_det)`` on a batch;
* ``ERRORS``: ``(make, exception type, message pattern)`` rows of bad input
  that the door refuses in one line; ``EXACT_ERRORS``: the same for the exact
  mode's options (see :func:`exact_in_bfloat16`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

BATCH = 16
WIDTH = 32
RATE = 0.1
TIME, MODEL, HEADS, MLP = 5, 16, 2, 32
FLOW_BATCH, FLOW_WIDTH = 4, 8
LEAK = 0.5  # the slope of a flow step's leaky ReLU (build_flow's leaky)


class Built(NamedTuple):
    """A door's model: ``apply(params, state, x, key) -> (y, new_state)`` is
    pure and jittable; ``params`` holds every trainable leaf (the same tree
    structure reversible or not)."""

    params: Any
    state: Any
    apply: Callable[[Any, Any, jax.Array, jax.Array], tuple[jax.Array, Any]]
    x: jax.Array


def example_input(seed, dtype, shape=None):
    """The input of a door's stack: normal, ``[BATCH, WIDTH]`` unless ``shape``
    (every door draws the same values for a seed)."""
    shape = (BATCH, WIDTH) if shape is None else shape
    return jax.random.normal(jax.random.key(seed + 1), shape, dtype)


class Flow(NamedTuple):
    """A door's flow: ``forward(params, x) -> (y, log_det)`` (``log_det`` of
    shape ``[batch]``) and ``inverse(params, y) -> x`` are pure; ``params``
    holds every trainable leaf, initialised from data on ``x``."""

    params: Any
    forward: Callable[[Any, jax.Array], tuple[jax.Array, jax.Array]]
    inverse: Callable[[Any, jax.Array], jax.Array]
    x: jax.Array


def flow_input(seed, dtype):
    """A flow's input: normal with mean 1 and standard deviation 2 (so that
    ActNorm's initialisation from data is not the identity)."""
    return 1.0 + 2.0 * example_input(seed, dtype, (FLOW_BATCH, FLOW_WIDTH))


def layer_input(dtype):
    """The input of the flow layers alone: an image batch ``[2, 4, 4, 4]``."""
    return 1.0 + 2.0 * example_input(0, dtype, (2, 4, 4, 4))


def exact_in_bfloat16(build):
    """A row's thunk: the door's exact stack built and applied on a bfloat16
    stream (which exact mode refuses)."""

    def thunk():
        built = build(2, dtype=jnp.bfloat16, reversible=True, exact=True)
        built.apply(built.params, built.state, built.x, jax.random.PRNGKey(0))

    return thunk
