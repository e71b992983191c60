"""What the compiled gradient stores per layer is what ``revnet.stored`` says.

For each kind of decision and kink the fuzzer draws, a coupling block that
uses it is looped with ``lax.scan`` inside one ``@revnet.invertible`` call, at
depth 8 and 40. Per layer, the compiled gradient's temp bytes
(``memory_analysis()``) must grow by what ``revnet.stored`` reports as growing
(within 10%), and by no more than plain autodiff of the same ``scan`` grows.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import revnet
from tests.helpers import temp_bytes

BATCH, WIDTH = 64, 8
DEPTHS = (8, 40)

# y -> a value that jumps or kinks at y's ties; each is multiplied by
# tanh(y @ w), as in the fuzzer's constructs.
DECISIONS = {
    "gt": lambda y: jnp.where(y > 0, 1.0, jnp.sin(y)),
    "sign": jnp.sign,
    "round": jnp.round,
    "argmax": lambda y: jax.nn.one_hot(jnp.argmax(y, -1), WIDTH, dtype=y.dtype),
    "top_k": lambda y: jnp.sum(
        jax.nn.one_hot(lax.top_k(y, 2)[1], WIDTH, dtype=y.dtype), -2
    ),
    "sort": lambda y: jnp.sort(y, -1),
    "int_cast": lambda y: (y + 0.5).astype(jnp.int32).astype(y.dtype),
    "mod": lambda y: jnp.mod(y, 0.5),
    "floor_divide": lambda y: jnp.floor_divide(y, 0.5),
    "reduce_precision": lambda y: lax.reduce_precision(
        y, exponent_bits=4, mantissa_bits=3
    ),
    "bf16_round_trip": lambda y: y.astype(jnp.bfloat16).astype(y.dtype),
    "searchsorted": lambda y: jnp.searchsorted(
        jnp.array([-0.5, 0.0, 0.5], y.dtype), y
    ).astype(y.dtype),
    "nan_guard": lambda y: (lambda u: jnp.where(jnp.isnan(u), 0.0, u))(
        y / jnp.where(y == 0, 0.0, y)
    ),
}
KINKS = {
    "relu": jax.nn.relu,
    "relu6": jax.nn.relu6,
    "hard_tanh": jax.nn.hard_tanh,
    "clip": lambda y: jnp.clip(y, -1.0, 0.5),
    "abs": jnp.abs,
    "max_axis": lambda y: jnp.max(y, -1, keepdims=True),
    "max_pool": lambda y: lax.reduce_window(
        y, -jnp.inf, lax.max, (1, 2), (1, 1), "SAME"
    ),
    "cummax": lambda y: lax.cummax(y, 1),
}


def _nets(jump, depth, kinks):
    def f(y, w):
        return jump(y) * jnp.tanh(y @ w) * 0.1

    def step(carry, w):
        a, b = carry
        a = a + f(b, w[0])
        b = b + f(a, w[1])
        return (a, b), None

    def plain(a, b, ws):
        return lax.scan(step, (a, b), ws)[0]

    rev = revnet.invertible(plain, known_argnums=2, kinks=kinks)
    return rev, plain


def _loss(net):
    def loss(a, b, ws):
        a, b = net(a, b, ws)
        return jnp.sum(a * a) + jnp.sum(jnp.sin(b))

    return jax.grad(loss, argnums=(0, 1, 2))


def _per_layer(jump, kinks):
    grown = {}
    for depth in DEPTHS:
        key = jax.random.PRNGKey(depth)
        a, b = jax.random.normal(key, (2, BATCH, WIDTH))
        ws = jax.random.normal(key, (depth, 2, WIDTH, WIDTH)) * 0.3
        rev, plain = _nets(jump, depth, kinks)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", revnet.StoredGrowthWarning)
            report = revnet.stored(rev, a, b, ws)
            grown[depth] = (
                temp_bytes(_loss(rev), a, b, ws),
                report.growing_bytes,
                temp_bytes(_loss(plain), a, b, ws),
            )
    span = DEPTHS[1] - DEPTHS[0]
    return [(grown[DEPTHS[1]][i] - grown[DEPTHS[0]][i]) / span for i in range(3)]


@pytest.mark.parametrize(
    "name, kinks",
    [(n, "recompute") for n in DECISIONS] + [(n, "store") for n in KINKS],
)
def test_compiled_growth_per_layer_is_what_is_reported(name, kinks):
    jump = {**DECISIONS, **KINKS}[name]
    compiled, reported, plain = _per_layer(jump, kinks)
    assert reported > 0, f"{name}: nothing reported as stored per layer"
    assert abs(compiled - reported) <= 0.1 * reported, (
        f"{name}: the gradient stores {compiled:.0f} B per layer, "
        f"revnet.stored reports {reported:.0f} B"
    )
    assert compiled <= plain, (
        f"{name}: {compiled:.0f} B per layer, more than plain autodiff's {plain:.0f}"
    )
