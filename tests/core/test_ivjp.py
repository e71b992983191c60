"""Tests of ``revnet.custom_ivjp``: inverses and inverse VJPs given by the user."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import revnet
from tests.helpers import (
    UNDER_CUSTOM_VJP3,
    assert_trees_close,
    cotangents_like,
    per_example_slogdet,
    tolerance,
)


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
        want = jax.grad(lambda x: jnp.sum(jnp.sin(plain(x))))(x)
        assert_trees_close(g, want, tolerance(jnp.float64))

        def net(a, b):
            return f(a) * 2.0 + jnp.tanh(b), b

        def net0(a, b):
            return plain(a) * 2.0 + jnp.tanh(b), b

        rtol = tolerance(jnp.float64)
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
            tolerance(jnp.float64, "values"),
        )

        def net(xs):  # closes over w: known to the inversion
            return scale(w, xs)

        got = jax.grad(
            lambda xs: loss(lambda w, xs: revnet.invertible(net)(xs))(w, xs)
        )(xs)
        want = jax.grad(lambda xs: loss(plain)(w, xs))(xs)
        assert_trees_close(got, want, tolerance(jnp.float64, "values"))


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
        rtol = tolerance(dtype)
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
    assert_trees_close(got, (jnp.full(3, 2.0),) * first, tolerance("float32", "values"))


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
            assert_trees_close(
                got, (jnp.full(3, 2.0),) * k, tolerance("float32", "values")
            )


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


# --------------------------------------------------------------------------- #
# Regressions: custom_ivjp functions that bucket their input (splines), and
# ones whose body reads an array constant, inside inversions and flows.

BOUND = 3.0  # the splines map [-BOUND, BOUND] onto itself, the identity outside


def _knots(raw):
    """Knots on [-BOUND, BOUND] from unconstrained bin sizes."""
    inner = -BOUND + 2 * BOUND * jnp.cumsum(jax.nn.softmax(raw))[:-1]
    end = jnp.full((1,), BOUND, raw.dtype)
    return jnp.concatenate([-end, inner, end])


def _bin(p, i):
    """Bin ``i``'s left knots and sizes: ``(x0, width, y0, height)``."""
    xk, yk = _knots(p["w"]), _knots(p["h"])
    return xk[i], xk[i + 1] - xk[i], yk[i], yk[i + 1] - yk[i]


def _linear(p, x):
    """A piecewise-linear spline, bucketed with ``jnp.searchsorted``."""
    i = jnp.searchsorted(_knots(p["w"])[1:-1], x, side="right")
    x0, w, y0, h = _bin(p, i)
    return jnp.where(jnp.abs(x) < BOUND, y0 + (x - x0) * (h / w), x)


def _linear_inverse(consts, y):
    (p,) = consts
    i = jnp.searchsorted(_knots(p["h"])[1:-1], y, side="right")
    x0, w, y0, h = _bin(p, i)
    return jnp.where(jnp.abs(y) < BOUND, x0 + (y - y0) * (w / h), y)


def _linear_log_slope(p, x):
    i = jnp.searchsorted(_knots(p["w"])[1:-1], x, side="right")
    _, w, _, h = _bin(p, i)
    return jnp.where(jnp.abs(x) < BOUND, jnp.log(h / w), 0.0)


def _rational_bin(p, x, knots):
    """A rational-quadratic bin, bucketed with ``sum(x[..., None] >= knots)``."""
    i = jnp.sum(x[..., None] >= knots[1:-1], -1)
    one = jnp.ones(1, x.dtype)
    d = jnp.concatenate([one, jax.nn.softplus(p["d"]) + 1e-3, one])
    return (*_bin(p, i), d[i], d[i + 1])


def _rational_parts(p, x):
    xc = jnp.clip(x, -BOUND, BOUND)
    x0, w, y0, h, d0, d1 = _rational_bin(p, xc, _knots(p["w"]))
    s, xi = h / w, (xc - x0) / w
    t = xi * (1 - xi)
    return y0, h, s, xi, t, d0, d1, s + (d1 + d0 - 2 * s) * t


def _rational(p, x):
    """A rational-quadratic spline (Durkan et al., 2019)."""
    y0, h, s, xi, t, d0, _, den = _rational_parts(p, x)
    return jnp.where(jnp.abs(x) < BOUND, y0 + h * (s * xi**2 + d0 * t) / den, x)


def _rational_inverse(consts, y):
    (p,) = consts
    yc = jnp.clip(y, -BOUND, BOUND)
    x0, w, y0, h, d0, d1 = _rational_bin(p, yc, _knots(p["h"]))
    s, dy = h / w, yc - y0
    e = d1 + d0 - 2 * s
    a, b, c = h * (s - d0) + dy * e, h * d0 - dy * e, -s * dy
    xi = 2 * c / (-b - jnp.sqrt(b * b - 4 * a * c))
    return jnp.where(jnp.abs(y) < BOUND, x0 + xi * w, y)


def _rational_log_slope(p, x):
    _, _, s, xi, t, d0, d1, den = _rational_parts(p, x)
    num = s**2 * (d1 * xi**2 + 2 * s * t + d0 * (1 - xi) ** 2)
    return jnp.where(jnp.abs(x) < BOUND, jnp.log(num) - 2 * jnp.log(den), 0.0)


SPLINES = {
    "linear": (_linear, _linear_inverse, _linear_log_slope),
    "rational": (_rational, _rational_inverse, _rational_log_slope),
}


def _spline(name):
    """The spline as a custom_ivjp function of ``(params, x)``, ``params`` a
    known constant."""
    fun, inverse, log_slope = SPLINES[name]
    f = revnet.custom_ivjp(fun, num_consts=1)
    f.definverse(inverse)
    f.deflogdet(log_slope)
    return f


def _flow(layer):
    """Three layers scanned over stacked params, reversing the features in
    between, summing each example's log-determinants on the way."""

    def flow(params, x):
        def step(carry, p):
            h, total = carry
            h, log_det = layer(p, h)
            return (h[..., ::-1], total + log_det), None

        return lax.scan(step, (x, jnp.zeros(x.shape[:1], x.dtype)), params)[0]

    return flow


def _spline_flows(name, decisions="store"):
    """``(revnet's flow, the same flow in plain JAX)``; each returns
    ``(outputs, log-determinants)``, the first through
    ``forward_and_log_det`` of the custom_ivjp in each step (the README's
    pattern), inside ``revnet.invertible``."""
    fun, _, log_slope = SPLINES[name]
    spline = _spline(name)

    def rev_layer(p, h):
        return revnet.forward_and_log_det(spline, p, h, known_argnums=0, batch_ndim=1)

    def plain_layer(p, h):
        return fun(p, h), jnp.sum(log_slope(p, h), -1)

    rev = revnet.invertible(_flow(rev_layer), known_argnums=0, decisions=decisions)
    return rev, _flow(plain_layer)


def _spline_params(dtype, bins=5, layers=3):
    k = jax.random.split(jax.random.key(3), 3)
    shapes = {"w": (layers, bins), "h": (layers, bins), "d": (layers, bins - 1)}
    return {
        n: 0.5 * jax.random.normal(key, shape, dtype)
        for key, (n, shape) in zip(k, shapes.items())
    }


def _spline_inputs(params, dtype, edges: bool):
    """Inputs past BOUND too; with ``edges``, three exactly on the edges of
    the first layer's buckets."""
    x = 2.0 * jax.random.normal(jax.random.key(4), (3, 6), dtype)
    return x.at[0, :3].set(_knots(params["w"][0])[1:4]) if edges else x


def _check_spline_flow(name, dtype, decisions, edges):
    rev, plain = _spline_flows(name, decisions)
    params = _spline_params(dtype)
    x = _spline_inputs(params, dtype, edges)
    rtol = tolerance(dtype)
    want = plain(params, x)
    assert_trees_close(rev(params, x), want, rtol, "output")
    cts = cotangents_like(want)

    def loss(f):
        return lambda p, x: sum(jnp.sum(o * c) for o, c in zip(f(p, x), cts))

    got = jax.grad(loss(rev), (0, 1))(params, x)
    assert_trees_close(got, jax.grad(loss(plain), (0, 1))(params, x), rtol, "grad")
    back = revnet.inverse(rev, params, x)(want)
    assert_trees_close(back, (params, x), rtol, "inverse")
    return rev, plain, params, x, want


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", sorted(SPLINES))
def test_spline_custom_ivjp_in_a_scanned_flow_matches_autodiff(name, dtype):
    """A custom_ivjp that buckets its input (searchsorted, ``>=`` knots,
    ``where``) in three scanned layers inside revnet.invertible: its inverse
    and log-determinant are the user's, and the buckets its body picks are
    stored, so that gradients equal jax.grad's even on a bucket's edge (where
    one rebuilt from the next layer's rounding would pick the other one)."""
    with jax.enable_x64(dtype == "float64"):
        rev, plain, params, x, want = _check_spline_flow(name, dtype, "store", True)
        if dtype != "float64":
            return
        ref = per_example_slogdet(lambda p, x: (plain(p, x)[0],), (params,), x)
        rtol = tolerance("float64", "log_det")
        np.testing.assert_allclose(want[1], ref, rtol=rtol)
        np.testing.assert_allclose(rev(params, x)[1], ref, rtol=rtol)
        # The log-determinant revnet derives through the user's deflogdet.
        stream = _flow(lambda p, h: (_spline(name)(p, h), 0.0))
        flow = revnet.invertible(lambda p, x: stream(p, x)[0], known_argnums=0)
        _, log_det = revnet.forward_and_log_det(flow, params, x, batch_ndim=1)
        np.testing.assert_allclose(log_det, ref, rtol=rtol)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", sorted(SPLINES))
def test_spline_custom_ivjp_with_decisions_recomputed(name, dtype):
    """With decisions="recompute" nothing is stored: the buckets are picked
    again from the rebuilt inputs (away from an edge, the same ones), and the
    per-example log-determinant is not refused (a lookup of bucket indices
    in a table keeps each example's values)."""
    with jax.enable_x64(dtype == "float64"):
        _check_spline_flow(name, dtype, "recompute", False)


def test_bucketing_custom_ivjp_inverts_and_has_its_log_det():
    """The reported case: invertible(f) and forward_and_log_det(f) of a
    custom_ivjp whose body buckets its input, an input on the edge too."""
    edges, slopes = jnp.array([0.0]), jnp.array([0.5, 2.0])

    @revnet.custom_ivjp
    def pwlin(x):
        return x * slopes[jnp.searchsorted(edges, x)]

    pwlin.definverse(lambda y: y / slopes[jnp.searchsorted(edges, y)])
    pwlin.deflogdet(lambda x: jnp.log(slopes[jnp.searchsorted(edges, x)]))
    x = jnp.array([-0.9, -0.2, 0.0, 0.3, 0.7])
    want = x * jnp.where(x > 0, 2.0, 0.5)
    np.testing.assert_allclose(revnet.invertible(pwlin)(x), want)
    y, log_det = revnet.forward_and_log_det(pwlin, x)
    np.testing.assert_allclose(y, want)
    closed = 3 * np.log(0.5) + 2 * np.log(2.0)
    np.testing.assert_allclose(log_det, closed, rtol=tolerance("float32", "values"))
    grad = jax.grad(lambda x: jnp.sum(jnp.sin(revnet.invertible(pwlin)(x))))(x)
    plain = jax.grad(lambda x: jnp.sum(jnp.sin(x * slopes[jnp.searchsorted(edges, x)])))
    assert_trees_close(grad, plain(x), tolerance("float32"))
    back = revnet.inverse(pwlin, x)(want)[0]
    np.testing.assert_allclose(back, x, rtol=tolerance("float32", "values"))


def _scaling(dtype):
    """A custom_ivjp whose body reads an array it closes over."""
    scale = jnp.array([0.5, 1.0, 2.0, 1.5], dtype)
    f = revnet.custom_ivjp(lambda x: x * scale)
    f.definverse(lambda y: y / scale)
    f.deflogdet(lambda x: jnp.sum(jnp.log(scale)) * jnp.ones(x.shape[:-1], dtype))
    return f, lambda x: x * scale


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_custom_ivjp_closing_over_an_array_in_a_flow_with_log_dets(dtype):
    """The README's scan with log-determinants, and forward_and_log_det of
    revnet.invertible(f): the call is matched to its function although the
    array it closes over is then an ordinary input of the traced call."""
    with jax.enable_x64(dtype == "float64"):
        f, plain_f = _scaling(dtype)

        def flow_of(layer):
            def flow(x):
                def step(c, _):
                    h, total = c
                    h, log_det = layer(h)
                    return (h, total + log_det), None

                init = (x, jnp.zeros(x.shape[:1], x.dtype))
                return lax.scan(step, init, None, length=3)[0]

            return flow

        rev = revnet.invertible(
            flow_of(lambda h: revnet.forward_and_log_det(f, h, batch_ndim=1))
        )
        log_scale = jnp.sum(jnp.log(jnp.array([0.5, 1.0, 2.0, 1.5], dtype)))
        plain = flow_of(lambda h: (plain_f(h), log_scale * jnp.ones(h.shape[:1])))
        x = jax.random.normal(jax.random.key(0), (2, 4), dtype)
        rtol = tolerance(dtype)
        want = plain(x)
        assert_trees_close(rev(x), want, rtol, "output")
        cts = cotangents_like(want)

        def loss(g):
            return lambda x: sum(jnp.sum(o * c) for o, c in zip(g(x), cts))

        assert_trees_close(jax.grad(loss(rev))(x), jax.grad(loss(plain))(x), rtol)
        assert_trees_close(revnet.inverse(rev, x)(want)[0], x, rtol, "inverse")
        y, log_det = revnet.forward_and_log_det(revnet.invertible(f), x, batch_ndim=1)
        assert_trees_close(y, plain_f(x), rtol, "output")
        if dtype == "float64":
            ref = per_example_slogdet(lambda x: (plain(x)[0],), (), x)
            np.testing.assert_allclose(want[1], ref, rtol=tolerance(dtype, "log_det"))
            ref1 = per_example_slogdet(lambda x: (plain_f(x),), (), x)
            np.testing.assert_allclose(log_det, ref1, rtol=tolerance(dtype, "log_det"))
