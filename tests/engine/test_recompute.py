"""A decision on values a few cheap equations make from stored copies is made
again from those copies, not stored; a contraction is not cheap, and what it
makes is stored instead of evaluated twice."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import revnet
from tests.helpers import assert_trees_close, dtype_rtol

BATCH, WIDTH = 64, 8
V = jnp.eye(WIDTH) * 0.7 + 0.1
COPY = BATCH * WIDTH * 4  # one float32 value of the stream

# rem stores a copy of y; the rounding's input is made from that copy.
JUMPS = {
    "elementwise": lambda y: jnp.round((y - lax.rem(y, 0.5)) * 3.0),
    "contraction": lambda y: jnp.round((y - lax.rem(y, 0.5)) @ V),
    "floor_divide": lambda y: jnp.floor_divide(y, 0.5),
}


def _net(jump):
    def step(carry, w):
        a, b = carry
        a = a + jump(b) * jnp.tanh(b @ w[0]) * 0.1
        b = b + jump(a) * jnp.tanh(a @ w[1]) * 0.1
        return (a, b), None

    def plain(a, b, ws):
        return lax.scan(step, (a, b), ws)[0]

    return plain


def _inputs(depth, dtype=jnp.float32):
    key = jax.random.PRNGKey(depth)
    a, b = jax.random.normal(key, (2, BATCH, WIDTH), dtype)
    ws = jax.random.normal(key, (depth, 2, WIDTH, WIDTH), dtype) * 0.3
    return a, b, ws


def _growth(jump) -> float:
    rev = revnet.invertible(_net(jump), known_argnums=2)
    grown = []
    for depth in (4, 12):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", revnet.StoredGrowthWarning)
            grown.append(revnet.stored(rev, *_inputs(depth)).growing_bytes)
    return (grown[1] - grown[0]) / 8


@pytest.mark.parametrize(
    "name, copies",
    [("elementwise", 1), ("floor_divide", 1), ("contraction", 2)],
)
def test_what_is_stored_per_coupling(name, copies):
    """Two couplings per layer, each storing ``copies`` values of the stream:
    rem's input, and the rounding's input only behind a contraction."""
    assert _growth(JUMPS[name]) == 2 * copies * COPY


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("name", sorted(JUMPS))
def test_gradients_equal_plain_autodiff(name, dtype):
    with jax.enable_x64(dtype == jnp.float64):
        plain = _net(JUMPS[name])
        rev = revnet.invertible(plain, known_argnums=2)
        args = _inputs(3, dtype)

        def loss(net):
            def f(a, b, ws):
                a, b = net(a, b, ws)
                return jnp.sum(a * a) + jnp.sum(jnp.sin(b))

            return jax.grad(f, argnums=(0, 1, 2))

        assert_trees_close(
            loss(rev)(*args), loss(plain)(*args), dtype_rtol(args), "gradient"
        )
