"""``known_argnums``: weights passed as arguments, JAX's functional idiom.

A known argument is closed over before tracing: saved like a closed-over value
and differentiated like one. Gradients are compared with ``jax.grad`` of the
same function, leaf by leaf; memory with the compiled program's
``memory_analysis``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import revnet
from tests.helpers import assert_trees_close, temp_bytes, tolerance

WIDTH = 16


def stack(params, x):
    """Additive couplings scanned over the layers of ``params``."""

    def layer(x, p):
        a, b = jnp.split(x, 2, -1)
        a = a + jnp.tanh(b @ p["w"] + p["b"])
        b = b + jax.nn.gelu(a @ p["v"])
        return jnp.concatenate([b, a], -1), None

    return jax.lax.scan(layer, x, params)[0]


def make_params(depth, dtype=jnp.float32, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    half = WIDTH // 2
    return {
        "w": jax.random.normal(k[0], (depth, half, half), dtype) / np.sqrt(half),
        "b": jax.random.normal(k[1], (depth, half), dtype) * 0.1,
        "v": jax.random.normal(k[2], (depth, half, half), dtype) / np.sqrt(half),
    }


def loss(f):
    return lambda p, x: jnp.sum(jnp.sin(f(p, x)))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gradients_equal_jax_grad_for_every_leaf(dtype):
    with jax.enable_x64(dtype == "float64"):
        params = make_params(6, dtype)
        x = jax.random.normal(jax.random.key(1), (5, WIDTH), dtype)
        rev = revnet.invertible(stack, known_argnums=0)
        got = jax.grad(loss(rev), (0, 1))(params, x)
        want = jax.grad(loss(stack), (0, 1))(params, x)
        assert_trees_close(got, want, tolerance(dtype), "gradients", exact_dtypes=True)
        jitted = jax.jit(jax.grad(loss(rev), (0, 1)))(params, x)
        assert_trees_close(jitted, want, tolerance(dtype), "jitted gradients")
        np.testing.assert_allclose(
            rev(params, x), stack(params, x), rtol=tolerance(dtype)
        )


def test_memory_is_flat_in_depth():
    x = jnp.ones((128, WIDTH))
    rev = revnet.invertible(stack, known_argnums=0)
    grad = jax.grad(loss(rev), (0, 1))
    plain = jax.grad(loss(stack), (0, 1))
    mem = {d: temp_bytes(grad, make_params(d), x) for d in (4, 64)}
    # Flat: sixteen times the depth holds no more activation memory.
    assert mem[64] <= mem[4], mem
    # ... where plain autodiff stores every layer's activations.
    assert temp_bytes(plain, make_params(64), x) > 8 * mem[64], mem


def test_the_refusal_names_the_option():
    params, x = make_params(3), jnp.ones((2, WIDTH))
    with pytest.raises(revnet.NotInvertibleError) as err:
        revnet.invertible(stack)(params, x)
    last = str(err.value).splitlines()[-1]
    assert last.startswith("try: known_argnums=0 if args[0]"), last
    assert "close over it" in last
    # Not offered where saving an argument would not help: the stream itself.
    with pytest.raises(revnet.NotInvertibleError) as err:
        revnet.invertible(lambda p, x: stack(p, x) + jnp.sum(x))(params, x)
    assert "try: known_argnums" not in str(err.value)


def test_conditioning_positions_and_decorator_form():
    """A conditioning input in the middle, a negative position, the decorator."""

    @revnet.invertible(known_argnums=(1, -1))
    def f(x, cond, scale):
        a, b = jnp.split(x, 2, -1)
        a = a + jnp.tanh(b * cond) * scale["s"]
        return jnp.concatenate([b, a], -1)

    def plain(x, cond, scale):
        return f.fun(x, cond, scale)

    args = (jnp.linspace(-1, 1, 8).reshape(2, 4), jnp.arange(2.0), {"s": 1.5})
    got = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), (0, 1, 2))(*args)
    want = jax.grad(lambda *a: jnp.sum(plain(*a) ** 2), (0, 1, 2))(*args)
    assert_trees_close(got, want, tolerance("float32"), "gradients")
    assert f.known_argnums == (1, -1)


def test_inverse_uses_the_known_values_and_returns_them():
    params, x = make_params(4), jax.random.normal(jax.random.key(2), (3, WIDTH))
    rev = revnet.invertible(stack, known_argnums=0)
    back = revnet.inverse(rev, params, x)(rev(params, x))
    assert back[0] is params
    np.testing.assert_allclose(back[1], x, atol=tolerance("float32", "round_trip"))
    structs = jax.ShapeDtypeStruct(x.shape, x.dtype)
    back = revnet.inverse(stack, params, structs, known_argnums=0)(stack(params, x))
    np.testing.assert_allclose(back[1], x, atol=tolerance("float32", "round_trip"))
    with pytest.raises(TypeError, match="args\\[0\\] is known.*not jax.ShapeDtype"):
        revnet.inverse(rev, jax.tree.map(lambda a: structs, params), x)


@pytest.mark.parametrize(
    "bad, match",
    [
        (2, "names argument 2, but stack was called with 2 positional"),
        ((0, 1), "names every argument"),
        ("0", "must be an int or a sequence of ints"),
        (True, "must be an int or a sequence of ints"),
    ],
)
def test_bad_positions_are_refused(bad, match):
    with pytest.raises(TypeError, match=match):
        revnet.invertible(stack, known_argnums=bad)(make_params(2), jnp.ones(WIDTH))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_keyword_arguments_are_known_and_differentiated(dtype):
    """``f(x, scale=s, context=c)``: keyword arguments are known, as closed-over
    values are; the gradient of every leaf, keywords included, is
    ``jax.grad``'s."""

    def flow(x, *, scale, context):
        def layer(h, w):
            a, b = jnp.split(h, 2, -1)
            b = b * jnp.exp(jnp.tanh(a @ w) * scale) + context["shift"]
            return jnp.concatenate([b, a], -1), None

        return lax.scan(layer, x, context["ws"])[0]

    def loss(wrap, x, scale, context):
        return jnp.sum(jnp.sin(wrap(flow)(x, scale=scale, context=context)))

    with jax.enable_x64(dtype == "float64"):
        key = jax.random.split(jax.random.key(3), 3)
        x = jax.random.normal(key[0], (5, 6), dtype)
        context = {
            "ws": 0.3 * jax.random.normal(key[1], (4, 3, 3), dtype),
            "shift": jax.random.normal(key[2], (3,), dtype),
        }
        scale = jnp.asarray(0.7, dtype)
        args = (x, scale, context)
        got = jax.grad(functools.partial(loss, revnet.invertible), (0, 1, 2))(*args)
        want = jax.grad(functools.partial(loss, lambda f: f), (0, 1, 2))(*args)
        assert_trees_close(got, want, tolerance(dtype), "gradient")
