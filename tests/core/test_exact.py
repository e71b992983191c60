"""``revnet.exact``: additive updates on a grid, rebuilt bit for bit.

Every reconstruction here is compared with ``==``, elementwise, no tolerance.
The stacks are ``lax.scan`` loops of additive couplings with MLP residuals
inside ONE ``revnet.invertible`` function (the weights are ``known_argnums``),
next to the same quantised program under plain autodiff.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import revnet
from tests.helpers import (
    assert_trees_close,
    compiled,
    flop_count,
    runtime_checks,
    temp_size,
    tolerance,
)


def _params(key, depth, width, hidden, dtype=jnp.float32, scale=0.3):
    half = width // 2
    ks = jax.random.split(key, 4)
    shapes = [(half, hidden), (hidden, half)] * 2
    return [
        (scale / np.sqrt(s[0])) * jax.random.normal(k, (depth, *s), dtype)
        for k, s in zip(ks, shapes)
    ]


def _block(p, x, bits):
    w1, w2, w3, w4 = p
    a, b = jnp.split(x, 2, -1)

    def add(u, d):
        return u + d if bits is None else revnet.exact.add(u, d, bits=bits)

    a = add(a, jnp.tanh(b @ w1) @ w2)
    b = add(b, jnp.tanh(a @ w3) @ w4)
    return jnp.concatenate([a, b], -1)


def _stack(bits):
    def stack(params, x):
        return lax.scan(lambda h, p: (_block(p, h, bits), None), x, params)[0]

    return stack


def _inverse(stack, params, y):
    return jax.jit(lambda p, y: revnet.inverse(lambda x: stack(p, x), y)(y)[0])(
        params, y
    )


def _reconstruct(depth, width=16, hidden=32, bits=10, dtype=jnp.float32, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = _params(k1, depth, width, hidden, dtype)
    x = revnet.exact.grid(jax.random.normal(k2, (8, width), dtype), bits=bits)
    stack = _stack(bits)
    y = jax.jit(revnet.invertible(stack, known_argnums=0))(params, x)
    return x, y, _inverse(stack, params, y), params


# -- grid and add ------------------------------------------------------------ #


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_grid_rounds_to_multiples_and_is_idempotent(dtype):
    with jax.enable_x64(dtype == jnp.float64):
        x = jax.random.normal(jax.random.key(0), (1000,), dtype) * 100
        for bits in (0, 3, 10):
            g = revnet.exact.grid(x, bits=bits)
            assert g.dtype == dtype
            scaled = np.asarray(g, np.float64) * 2.0**bits
            assert np.array_equal(scaled, np.round(scaled))
            assert float(jnp.max(jnp.abs(g - x))) <= 2.0 ** -(bits + 1)
            assert jnp.array_equal(revnet.exact.grid(g, bits=bits), g)


def test_grid_and_add_differentiate_straight_through():
    x = jnp.linspace(-2.0, 2.0, 7)
    w = jnp.arange(7.0)
    assert jnp.array_equal(jax.grad(lambda x: w @ revnet.exact.grid(x))(x), w)
    gx, gd = jax.grad(lambda x, d: w @ revnet.exact.add(x, d), (0, 1))(x, 0.3 * x)
    assert jnp.array_equal(gx, w) and jnp.array_equal(gd, w)


def test_default_grid_leaves_the_same_range_in_each_dtype():
    for dtype, bits in ((jnp.float32, 10), (jnp.float64, 39)):
        assert revnet.exact.bits_for(dtype) == bits
        assert revnet.exact.limit(dtype, bits) == 2.0**revnet.exact.RANGE_BITS


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: revnet.exact.grid(jnp.ones(2, jnp.bfloat16)), TypeError, "float32"),
        (lambda: revnet.exact.grid(jnp.ones(2, jnp.float16)), TypeError, "11 bits"),
        (lambda: revnet.exact.grid(jnp.ones(2, jnp.int32)), TypeError, "floating"),
        (lambda: revnet.exact.grid(jnp.ones(2), bits=24), ValueError, "below the 24"),
        (lambda: revnet.exact.grid(jnp.ones(2), bits=-1), ValueError, "exact_bits"),
        (lambda: revnet.exact.grid(jnp.ones(2), bits=2.5), TypeError, "exact_bits"),
        (
            lambda: revnet.exact.add(jnp.ones(2), jnp.ones(3)),
            ValueError,
            "does not broadcast",
        ),
    ],
)
def test_bad_input_is_refused_in_one_line(call, error, match):
    with pytest.raises(error, match=match) as info:
        call()
    assert "\n" not in str(info.value)


# -- bit-exact reconstruction ------------------------------------------------- #


def test_depth_1000_stack_rebuilds_its_input_bit_for_bit():
    x, y, back, _ = _reconstruct(1000)
    assert jnp.array_equal(back, x)
    # The same stack in plain float does not: the premise of the test.
    stack = _stack(None)
    params = _reconstruct(1000)[3]
    back_plain = _inverse(stack, params, stack(params, x))
    assert not jnp.array_equal(back_plain, x)


@pytest.mark.slow
def test_depth_10000_stack_rebuilds_its_input_bit_for_bit():
    x, y, back, _ = _reconstruct(10_000, seed=1)
    assert jnp.array_equal(back, x)
    assert float(jnp.max(jnp.abs(y))) > 4 * float(jnp.max(jnp.abs(x)))


def _random_case(rng):
    """A random exact stack whose input sits near the top of its range."""
    depth = int(rng.integers(1, 200))
    width = 2 * int(rng.integers(1, 12))
    bits = int(rng.integers(2, 20))
    limit = revnet.exact.limit(jnp.float32, bits)
    scale = float(rng.uniform(0.3, 0.2 * depth))
    params = _params(jax.random.key(int(rng.integers(2**31))), depth, width, 8)
    params = [p * scale for p in params]
    x = rng.uniform(-1, 1, (4, width)).astype(np.float32)
    x = revnet.exact.grid(jnp.asarray(x * limit * rng.uniform(0.5, 0.999)), bits=bits)
    return depth, width, bits, limit, params, x


@pytest.mark.parametrize(
    "n", [pytest.param(6, id="6"), pytest.param(60, id="60", marks=pytest.mark.slow)]
)
def test_random_exact_stacks_are_never_rebuilt_inexactly(n):
    """Random depths, widths, grids, and inputs near the range's limit: every
    reconstruction is the input bit for bit, or refused with NaN where the
    forward stream reached the limit; never a finite wrong value."""
    rng = np.random.default_rng(n)
    exact = refused = 0
    for _ in range(n):
        depth, width, bits, limit, params, x = _random_case(rng)
        stack = _stack(bits)

        def peak(params, x, bits=bits):
            def step(h, p):
                h = _block(p, h, bits)
                return h, jnp.max(jnp.abs(h))

            return jnp.max(lax.scan(step, x, params)[1])

        y = jax.jit(stack)(params, x)
        with runtime_checks(False):  # a refusal is NaN: counted below
            back = _inverse(stack, params, y)
        finite = jnp.isfinite(back)
        assert jnp.array_equal(jnp.where(finite, back, x), x), (depth, width, bits)
        if bool(jnp.all(finite)):
            exact += 1
        else:
            refused += 1
            assert float(jax.jit(peak)(params, x)) >= limit, (depth, width, bits)
    assert exact > 0 and exact + refused == n


# -- gradients, memory, FLOPs -------------------------------------------------- #


def _grads(stack, params, x, rev):
    def loss(params, x):
        f = revnet.invertible(stack, known_argnums=0) if rev else stack
        return jnp.sum(jnp.sin(f(params, x)))

    return jax.jit(jax.grad(loss, (0, 1)))(params, x)


@pytest.mark.parametrize(
    "compiled_as",
    ["suite", pytest.param("optimized", marks=pytest.mark.optimized)],
)
def test_gradients_equal_plain_autodiff_of_the_quantised_program_bit_for_bit(
    compiled_as,
):
    x, _, _, params = _reconstruct(64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing grows with depth
        got = _grads(_stack(10), params, x, True)
    want = _grads(_stack(10), params, x, False)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.array_equal(a, b)


@pytest.mark.slow
def test_float64_gradients_equal_jax_grad_of_the_quantised_function():
    with jax.enable_x64(True):
        x, _, _, params = _reconstruct(64, bits=39, dtype=jnp.float64)
        got = _grads(_stack(39), params, x, True)
        want = _grads(_stack(39), params, x, False)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert a.dtype == jnp.float64
            scale = max(1.0, float(jnp.max(jnp.abs(b))))
            # exact (quantised) reconstruction: only the backward's own rounding
            assert float(jnp.max(jnp.abs(a - b))) <= 1e-12 * scale


def _grad_program(bits, depth, width=32, hidden=64):
    params = _params(jax.random.key(0), depth, width, hidden)
    x = revnet.exact.grid(jnp.ones((8, width)) * 0.5)

    def loss(params, x):
        return jnp.sum(revnet.invertible(_stack(bits), known_argnums=0)(params, x))

    return compiled(jax.grad(loss, (0, 1)), params, x)


def test_memory_is_flat_in_depth_and_that_of_the_inexact_stack():
    with runtime_checks(False):  # the default: the checks' flags cost bytes
        exact = [temp_size(_grad_program(10, d)) for d in (8, 64)]
        plain = [temp_size(_grad_program(None, d)) for d in (8, 64)]
    assert exact[0] == exact[1], exact
    assert exact[1] == plain[1], (exact, plain)
    stored = revnet.stored(
        lambda p, x: jnp.sum(revnet.invertible(_stack(10), known_argnums=0)(p, x)),
        _params(jax.random.key(0), 8, 32, 64),
        jnp.ones((8, 32)),
    )
    assert stored.growing_bytes == 0, stored


def _unrolled_flops(bits, depth, width=256, hidden=256):
    """FLOPs of the gradient of ``depth`` couplings written out one by one."""
    params = _params(jax.random.key(0), depth, width, hidden)
    x = revnet.exact.grid(jnp.ones((8, width)) * 0.5)

    def stack(params, x):
        for i in range(depth):
            x = _block([p[i] for p in params], x, bits)
        return x

    def loss(params, x):
        return jnp.sum(revnet.invertible(stack, known_argnums=0)(params, x))

    return flop_count(compiled(jax.grad(loss, (0, 1)), params, x))


def test_flops_per_layer_are_at_most_ten_percent_above_the_inexact_coupling():
    with runtime_checks(False):
        exact = _unrolled_flops(10, 3) - _unrolled_flops(10, 2)
        plain = _unrolled_flops(None, 3) - _unrolled_flops(None, 2)
    assert plain > 0
    assert exact <= 1.10 * plain, (exact, plain, exact / plain)


# -- out of range --------------------------------------------------------------- #


def _far_out(name):
    params = _params(jax.random.key(0), 4, 8, 8)
    x = revnet.exact.grid(jnp.full((2, 8), 3000.0), bits=12)  # limit 4096

    def stack(params, x):
        def body(h, p):
            w1, w2, w3, w4 = p
            a, b = jnp.split(h, 2, -1)
            a = revnet.exact.add(a, 900.0 + jnp.tanh(b @ w1) @ w2, bits=12, name=name)
            b = revnet.exact.add(b, jnp.tanh(a @ w3) @ w4, bits=12, name=name)
            return jnp.concatenate([a, b], -1), None

        return lax.scan(body, x, params)[0]

    return stack, params, x


def test_leaving_the_range_is_an_error_naming_the_layer_with_runtime_checks():
    stack, params, x = _far_out("layer 'mixer'")

    def loss(params, x):
        return jnp.sum(revnet.invertible(stack, known_argnums=0)(params, x))

    with runtime_checks(True):
        with pytest.raises(revnet.NotInvertibleError, match="exact range") as info:
            jax.block_until_ready(jax.grad(loss)(params, x))
    assert "layer 'mixer' left its exact range" in str(info.value)
    assert "\n" not in str(info.value)
    with runtime_checks(False):  # never a silently inexact value
        y = stack(params, x)
        back = _inverse(stack, params, y)
        assert bool(jnp.any(jnp.isnan(back)))
        g = jax.grad(loss)(params, x)
        assert bool(jnp.any(jnp.isnan(g[2]))), "G's weights read the rebuilt half"


def test_log_det_of_an_exact_stack_is_zero():
    x, _, _, params = _reconstruct(4)
    y, log_det = revnet.forward_and_log_det(
        lambda x: _stack(10)(params, x), x, batch_ndim=1
    )
    assert jnp.array_equal(y, _stack(10)(params, x))
    assert jnp.array_equal(log_det, jnp.zeros(8))


def test_the_docstrings_examples_run():
    import doctest

    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    for test in doctest.DocTestFinder().find(revnet.exact, globs={}):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted >= 10 and result.failed == 0, result


def _leapfrog(theta, bits):
    """A kick-drift-kick step in a learned potential, a harmonic well plus a
    small learned term (stable, so its gradients stay of order one), exact."""

    def force(q):
        return -q - jax.grad(lambda q: 0.1 * jnp.sum(jnp.tanh(q @ theta) ** 2))(q)

    def step(carry):
        i, q, p = carry
        p = revnet.exact.add(p, 0.05 * force(q), bits=bits)
        q = revnet.exact.add(q, 0.1 * p, bits=bits)
        p = revnet.exact.add(p, 0.05 * force(q), bits=bits)
        return i + 1, q, p

    return step


def test_exact_while_loop_rebuilds_its_carry_in_memory_flat_in_the_steps():
    theta = 0.5 * jax.random.normal(jax.random.key(0), (4, 4))
    q0 = revnet.exact.grid(jax.random.normal(jax.random.key(1), (3, 4)), bits=16)
    p0 = jnp.zeros_like(q0)
    step = _leapfrog(theta, 16)

    def final(theta, q0, steps, rev=True):
        if not rev:
            carry = (0, q0, p0)
            return lax.fori_loop(0, steps, lambda _, c: _leapfrog(theta, 16)(c), carry)
        return revnet.while_loop(
            lambda c: c[0] < steps,
            _leapfrog(theta, 16),
            (0, q0, p0),
            max_steps=steps,
            mode="invert",
        )

    def loss(theta, q0, steps, rev=True):
        _, q, p = final(theta, q0, steps, rev)
        return jnp.sum(q**2) + jnp.sum(p**2)

    # The steps run backwards from the end give the start bit for bit.
    back = jax.jit(final, static_argnums=2)(theta, q0, 500)
    inverse = jax.jit(lambda c: revnet.inverse(step, c)(c)[0])
    for _ in range(500):
        back = inverse(back)
    assert int(back[0]) == 0
    assert jnp.array_equal(back[1], q0) and jnp.array_equal(back[2], p0)
    got = jax.jit(jax.grad(loss, (0, 1)), static_argnums=2)(theta, q0, 500)
    want = jax.grad(loss, (0, 1))(theta, q0, 500, False)
    assert_trees_close(got, want, rtol=tolerance(jnp.float32, loops=True))
    with runtime_checks(False):
        mem = [
            temp_size(compiled(jax.grad(lambda t, q: loss(t, q, n)), theta, q0))
            for n in (1000, 100_000)
        ]
    assert mem[0] == mem[1], mem
