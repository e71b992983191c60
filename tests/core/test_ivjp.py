"""Tests of ``revnet.custom_ivjp``: inverses and inverse VJPs given by the user."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import revnet
from tests.helpers import UNDER_CUSTOM_VJP3, assert_trees_close


def _normal(seed, shape, dtype=jnp.float64):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def _newton_cubic():
    @revnet.custom_ivjp
    def f(x):
        return x + x**3 / 3.0  # monotone; its inverse needs a solve

    @f.definverse
    def _(y):
        x = y
        for _ in range(50):
            x = x - (x + x**3 / 3.0 - y) / (1.0 + x**2)
        return (x,)

    return f


def test_custom_ivjp_definverse_direct_and_inside_invertible():
    with jax.enable_x64(True):
        f = _newton_cubic()
        x = _normal(0, (5,))
        plain = lambda x: x + x**3 / 3.0  # noqa: E731
        g = jax.grad(lambda x: jnp.sum(jnp.sin(f(x))))(x)
        assert_trees_close(g, jax.grad(lambda x: jnp.sum(jnp.sin(plain(x))))(x), 1e-10)

        def net(a, b):
            return f(a) * 2.0 + jnp.tanh(b), b

        def net0(a, b):
            return plain(a) * 2.0 + jnp.tanh(b), b

        rtol = 1e-10
        got = jax.grad(
            lambda a, b: jnp.sum(jnp.sin(revnet.invertible(net)(a, b)[0])), (0, 1)
        )(x, x)
        want = jax.grad(lambda a, b: jnp.sum(jnp.sin(net0(a, b)[0])), (0, 1))(x, x)
        assert_trees_close(got, want, rtol)
        back = revnet.inverse(net, x, x)(net(x, x))
        assert_trees_close(back, (x, x), rtol)


def test_custom_ivjp_defivjp_only_with_constants_and_pytrees():
    with jax.enable_x64(True):

        @revnet.custom_ivjp
        def scale(w, xs):
            return {"y": xs[0] * jnp.exp(w), "z": xs[1] - w}

        @scale.defivjp
        def _(consts, outs, cts):
            (w,) = consts
            x0 = outs["y"] * jnp.exp(-w)
            x1 = outs["z"] + w
            ct_w = jnp.sum(cts["y"] * outs["y"]) - jnp.sum(cts["z"])
            ct_x = (cts["y"] * jnp.exp(w), cts["z"])
            return ((x0, x1),), (ct_w, ct_x)

        scale.num_consts = 1
        w = jnp.float64(0.3)
        xs = (_normal(0, (4,)), _normal(1, (4,)))

        def plain(w, xs):
            return {"y": xs[0] * jnp.exp(w), "z": xs[1] - w}

        def loss(f):
            return lambda w, xs: (
                jnp.sum(jnp.sin(f(w, xs)["y"])) + jnp.sum(f(w, xs)["z"] ** 2)
            )

        assert_trees_close(
            jax.grad(loss(scale), (0, 1))(w, xs),
            jax.grad(loss(plain), (0, 1))(w, xs),
            1e-12,
        )

        def net(xs):  # closes over w: known to the inversion
            return scale(w, xs)

        got = jax.grad(
            lambda xs: loss(lambda w, xs: revnet.invertible(net)(xs))(w, xs)
        )(xs)
        want = jax.grad(lambda xs: loss(plain)(w, xs))(xs)
        assert_trees_close(got, want, 1e-12)


def test_custom_ivjp_without_rules_raises():
    f = revnet.custom_ivjp(lambda x: x * 2.0)
    with pytest.raises(revnet.NotInvertibleError, match="definverse or defivjp"):
        f(jnp.ones(2))
    with pytest.raises(TypeError, match="callable"):
        revnet.custom_ivjp(3)


# --------------------------------------------------------------------------- #
# Regressions: custom_ivjp closing over arrays, and called at several arities.


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_custom_ivjp_closing_over_concrete_arrays_inverts_inside_invertible(dtype):
    with jax.enable_x64(dtype == jnp.float64):
        w = jnp.linspace(0.5, 2.0, 4, dtype=dtype)  # hoisted by JAX as a constant
        calls = []

        @revnet.custom_ivjp
        def scale(x):
            return x * w

        @scale.definverse
        def _(y):
            calls.append(1)
            return y / w

        def net(a, b):
            return scale(a) + jnp.tanh(b), b

        def plain(a, b):
            return a * w + jnp.tanh(b), b

        a, b = _normal(0, (4,), dtype), _normal(1, (4,), dtype)
        rtol = 1e-5 if dtype == jnp.float32 else 1e-10
        loss = lambda f: lambda a, b: jnp.sum(jnp.sin(f(a, b)[0]) * f(a, b)[1])  # noqa: E731
        got = jax.grad(loss(revnet.invertible(net)), (0, 1))(a, b)
        assert calls, "the user's inverse was not called"
        assert_trees_close(got, jax.grad(loss(plain), (0, 1))(a, b), rtol)
        assert_trees_close(revnet.inverse(net, a, b)(net(a, b)), (a, b), rtol)


@pytest.mark.skipif(
    UNDER_CUSTOM_VJP3,
    reason="JAX_CUSTOM_VJP3 refuses a custom_vjp closing over a tracer itself",
)
def test_custom_ivjp_closing_over_a_value_traced_inside_is_refused_clearly():
    def net(a, b):
        w = jnp.exp(b)  # a tracer of the function being inverted

        @revnet.custom_ivjp
        def scale(x):
            return x * w

        scale.definverse(lambda y: y / w)
        return scale(a), b

    x = jnp.ones(3)
    with pytest.raises(revnet.NotInvertibleError, match="'scale' closes over a traced"):
        jax.grad(lambda a, b: jnp.sum(revnet.invertible(net)(a, b)[0]))(x, x)


def _doubling():
    """A variadic custom_ivjp: one array in, one out; several in, a tuple out."""

    @revnet.custom_ivjp
    def double(*xs):
        return 2.0 * xs[0] if len(xs) == 1 else tuple(2.0 * x for x in xs)

    @double.definverse
    def _(ys):
        return ys / 2.0 if not isinstance(ys, tuple) else tuple(y / 2.0 for y in ys)

    return double


@pytest.mark.parametrize("first", [1, 2])
def test_custom_ivjp_backward_uses_the_arity_of_its_own_call(first):
    double = _doubling()
    x = jnp.linspace(-1.0, 1.0, 3)
    args = (x,) * first
    out, vjp = jax.vjp(double, *args)
    double(*(x,) * (3 - first))  # another arity, between forward and backward
    got = vjp(jax.tree_util.tree_map(jnp.ones_like, out))
    assert_trees_close(got, (jnp.full(3, 2.0),) * first, 1e-6)


def test_custom_ivjp_called_from_threads_at_two_arities():
    import concurrent.futures

    double = _doubling()
    x = jnp.linspace(-1.0, 1.0, 3)

    def work(n):
        k = 1 + n % 2
        results = []
        for _ in range(10):
            out, vjp = jax.vjp(double, *(x,) * k)
            results.append(vjp(jax.tree_util.tree_map(jnp.ones_like, out)))
        return k, results

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        done = list(pool.map(work, range(16)))
    for k, results in done:
        for got in results:
            assert_trees_close(got, (jnp.full(3, 2.0),) * k, 1e-6)


def test_revnet_scan_inside_inverse_uses_each_custom_ivjps_own_inverse():
    """Two custom_ivjp functions with the same forward and different inverses:
    revnet.scan's cached forward loop must not hand the first one's inverse to
    an enclosing inversion of the second."""
    x = jnp.arange(3.0)
    results = []
    for k in (1.0, 2.0):
        double = revnet.custom_ivjp(lambda x: 2.0 * x)
        calls = []

        @double.definverse
        def _(y, calls=calls, k=k):
            calls.append(1)
            return y / 2.0 * k  # k = 2: deliberately not the true inverse

        def f(x, double=double):
            y, _ = revnet.scan(lambda c, _: (double(c), None), x, length=3)
            return y

        (back,) = revnet.inverse(f, x)(f(x))
        assert calls, f"the inverse of function {k} was not called"
        results.append(back)
    np.testing.assert_allclose(results[0], x)
    np.testing.assert_allclose(results[1], x * 8.0)
