"""Regression tests: no silently wrong gradient, no needless refusal.

Each case is a program users write whose gradient is easy to get silently
wrong, or that is easy to refuse needlessly.
Gradients are compared with plain ``jax.grad`` of the same function, for every
input and every closed-over weight, elementwise, in float32 and float64.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import revnet
from revnet._engine import runtime_checks
from tests.helpers import assert_trees_close, tolerance

DTYPES = ["float32", "float64"]


def _x(dtype, shape=(3, 4), seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.dtype(dtype))


def _loss(f):
    def loss(*args):
        out = f(*args)
        return sum(
            jnp.sum(jnp.sin(y) * (1.0 + n))
            for n, y in enumerate(jax.tree_util.tree_leaves(out))
        )

    return loss


def check_grads(f, *args, dtype="float32", rtol=None):
    """Values, input gradients and the inverse of ``f`` against plain JAX."""
    rtol = tolerance(dtype) if rtol is None else rtol
    argnums = tuple(range(len(args)))
    rf = revnet.invertible(f)
    assert_trees_close(rf(*args), f(*args), rtol, "values")
    got = jax.grad(_loss(rf), argnums)(*args)
    want = jax.grad(_loss(f), argnums)(*args)
    assert_trees_close(got, want, rtol, "gradients")
    back = revnet.inverse(f, *args)(f(*args))
    assert_trees_close(back, args, rtol * 10, "inverse")  # inverting amplifies rounding


def _weights_grad(make, w, x):
    """Gradients w.r.t. a closed-over weight and the input, reversible vs plain."""

    def loss(w, x, rev):
        f = make(w)
        return _loss(revnet.invertible(f) if rev else f)(x)

    g = jax.grad(loss, (0, 1))
    return g(w, x, True), g(w, x, False)


# --------------------------------------------------------------------------- #
# Custom derivative rules on the inverted path are honoured.


@jax.custom_vjp
def grad_reverse(x):
    return x


grad_reverse.defvjp(lambda x: (x, None), lambda _, g: (-g,))


@jax.custom_vjp
def clip_grad(x):
    return x


clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.1, 0.1),))


@jax.custom_jvp
def straight_through(x):
    return x * 3.0


straight_through.defjvp(lambda p, t: (straight_through(p[0]), t[0]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "name,f",
    [
        ("gradient reversal", lambda x: grad_reverse(x) * 2.0),
        ("gradient clipping", lambda x: jnp.sinh(clip_grad(x * 3.0)) + 1.0),
        ("custom_jvp", lambda x: straight_through(x) - 1.0),
        (
            "inside a scan",
            lambda x: lax.scan(
                lambda c, _: (grad_reverse(c) * 1.5, None), x, None, length=3
            )[0],
        ),
    ],
)
def test_custom_rules_on_the_inverted_path(name, f, dtype):
    with jax.enable_x64(dtype == "float64"):
        check_grads(f, _x(dtype), dtype=dtype)


def test_custom_vjp_in_a_coupling_with_weights_gets_every_gradient():
    def make(w):
        def f(x1, x2):
            y1 = x1 + jnp.tanh(clip_grad(x2) @ w)
            y2 = grad_reverse(x2) - jnp.tanh(y1 @ w.T)
            return y1, y2

        return f

    w, x = _x("float32", (4, 4), 1), _x("float32")

    def loss(w, x1, x2, rev):
        f = make(w)
        return _loss(revnet.invertible(f) if rev else f)(x1, x2)

    g = jax.grad(loss, (0, 1, 2))
    rtol = tolerance("float32")
    assert_trees_close(g(w, x, x * 2, True), g(w, x, x * 2, False), rtol, "grads")


# --------------------------------------------------------------------------- #
# Caches keyed on everything that determines the result.


def test_nested_jit_with_changed_closed_over_weights_is_not_stale():
    weights = {"w": jnp.float32(2.0)}

    def f(z):
        return jax.jit(lambda z: z * weights["w"])(z)

    rf = revnet.invertible(f)
    x = _x("float32")
    for w in (2.0, 5.0, -0.5):
        weights["w"] = jnp.float32(w)
        rtol = tolerance("float32", "values")  # one multiplication
        assert_trees_close(rf(x), f(x), rtol, "values")
        got = jax.grad(_loss(rf))(x)
        assert_trees_close(got, jax.grad(_loss(f))(x), rtol, "gradients")


_HYPER: dict = {}


def _scaled_grad(scale):
    @jax.custom_vjp
    def f(x):
        return x

    f.defvjp(lambda x: (x, None), lambda _, g: (g * scale,))
    return f


def _net(x):
    return _scaled_grad(_HYPER["scale"])(x) * 2.0 + 1.0


_rev_net = revnet.invertible(_net)


@pytest.mark.parametrize("dtype", DTYPES)
def test_static_hyper_parameter_under_jit_retrace(dtype):
    @functools.partial(jax.jit, static_argnums=(1, 2))
    def step(x, scale, rev):
        _HYPER["scale"] = scale
        return jax.grad(_loss(_rev_net if rev else _net))(x)

    with jax.enable_x64(dtype == "float64"):
        x = _x(dtype)
        for scale in (1.0, -3.0, 0.25):
            assert_trees_close(
                step(x, scale, True), step(x, scale, False), tolerance(dtype), "grad"
            )


@pytest.mark.slow
def test_caches_are_bounded():
    from revnet._engine import PLAN_CACHE

    rf = revnet.invertible(lambda x: x * 2.0)
    # A plan per input shape: tracing fills the cache (eager calls would also
    # compile 512 programs); the 10 calls past its size run eagerly.
    for n in range(PLAN_CACHE.size):
        jax.eval_shape(rf, jax.ShapeDtypeStruct((n + 1,), jnp.float32))
    for n in range(PLAN_CACHE.size, PLAN_CACHE.size + 10):
        rf(jnp.ones((n + 1,)))
    assert len(PLAN_CACHE) == PLAN_CACHE.size
    for n in range(100):
        revnet.inverse(lambda x: x + 1.0, jnp.ones((n + 1,)))
    assert len(PLAN_CACHE) == PLAN_CACHE.size


# --------------------------------------------------------------------------- #
# Information-losing programs are refused at trace time.

_MASK = np.array([True, False, True, False])

LOSSY = [
    ("0 * sinh(x)", lambda x: 0 * jnp.sinh(x), "constant zero"),
    ("sinh(x) / 0", lambda x: jnp.sinh(x) / 0.0, "constant zero"),
    ("where(mask, x, x * 0)", lambda x: jnp.where(_MASK, x, x * 0), "select_n"),
    ("x * zeros_like(x)", lambda x: x * jnp.zeros(x.shape, x.dtype), "constant zero"),
    ("0 / x", lambda x: 0.0 / (x + 3.0), "constant zero"),
    ("to bfloat16", lambda x: x.astype(jnp.bfloat16), "narrowing"),
    ("to float16", lambda x: x.astype(jnp.float16), "narrowing"),
    (
        "detour through bfloat16",
        lambda x: x.astype(jnp.bfloat16).astype(jnp.float32) * 2.0,
        "narrowing",
    ),
    ("singular constant matrix", lambda x: x @ jnp.ones((4, 4)), "singular"),
]


@pytest.mark.parametrize("name,f,reason", LOSSY, ids=[c[0] for c in LOSSY])
def test_information_losing_programs_are_refused(name, f, reason):
    x = _x("float32")
    with pytest.raises(revnet.NotInvertibleError, match=reason):
        revnet.invertible(f)(x)
    with pytest.raises(revnet.NotInvertibleError, match=reason):
        revnet.inverse(f, x)


def test_coupling_with_a_zeroed_stream_is_refused():
    w = _x("float32", (4, 4), 1)

    def f(x1, x2):
        return x1 * 0.0 + jnp.tanh(x2 @ w), x2

    with pytest.raises(revnet.NotInvertibleError, match="constant zero"):
        revnet.invertible(f)(_x("float32"), _x("float32"))


def test_widening_conversions_are_accepted():
    x16, xb16 = _x("float16"), _x("bfloat16")
    check_grads(lambda x: x.astype(jnp.float32) * 2.0, x16, rtol=1e-3)  # float16's eps
    check_grads(lambda x: x.astype(jnp.float32) + 1.0, xb16, rtol=1e-2)  # bfloat16's
    with jax.enable_x64(True):
        check_grads(lambda x: jnp.sinh(x.astype(jnp.float64)), _x("float32"))


# --------------------------------------------------------------------------- #
# Values that make a program degenerate at run time raise (with checks on).


def _degenerate_cases():
    def zero_weight(w):
        return lambda x: jnp.sinh(x * w)

    def singular(w):
        return lambda x: x @ (jnp.eye(4) * w)

    def saturated(w):
        return lambda x: jnp.tanh(x * w)

    def dropout_on_stream(w):
        keep = jax.random.bernoulli(jax.random.key(3), 0.5, (3, 4))
        return lambda x: x * (keep.astype(x.dtype) * w) + 1.0

    return [
        ("zero weight", zero_weight, jnp.float32(0.0), jnp.float32(2.0)),
        ("singular known matrix", singular, jnp.float32(0.0), jnp.float32(1.5)),
        ("saturated tanh", saturated, jnp.float32(100.0), jnp.float32(0.5)),
        ("dropout mask on the stream", dropout_on_stream, jnp.float32(2.0), None),
    ]


CASES = _degenerate_cases()


@pytest.fixture
def checks_on():
    runtime_checks.set_runtime_checks(True)
    yield
    runtime_checks.set_runtime_checks(None)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("name,make,bad,good", CASES, ids=[c[0] for c in CASES])
def test_degenerate_values_raise_at_run_time(name, make, bad, good, jit, checks_on):
    x = _x("float32")

    def grad(w):
        g = jax.grad(lambda w, x: _loss(revnet.invertible(make(w)))(x), (0, 1))
        return (jax.jit(g) if jit else g)(w, x)

    with pytest.raises(
        (revnet.NotInvertibleError, jax.errors.JaxRuntimeError), match="non-finite"
    ):
        jax.block_until_ready(grad(bad))
    if good is not None:  # the same program at regular values is fine
        got = grad(good)
        want = jax.grad(lambda w, x: _loss(make(w))(x), (0, 1))(good, x)
        assert_trees_close(got, want, tolerance("float32"), "gradients")


def test_degenerate_values_without_checks_give_nan_not_a_finite_lie():
    runtime_checks.set_runtime_checks(False)
    try:
        g = jax.grad(
            lambda w: _loss(revnet.invertible(lambda x: jnp.sinh(x * w)))(_x("float32"))
        )
        assert np.isnan(g(jnp.float32(0.0)))
    finally:
        runtime_checks.set_runtime_checks(None)


def test_runtime_checks_cover_inverse_and_reversed_scans(checks_on):
    def f(x, w):
        return lax.scan(lambda c, _: (jnp.tanh(c) * w, None), x, None, length=3)[0]

    x = _x("float32")
    zero = jnp.zeros((4,))  # a closed-over array, not a literal
    with pytest.raises(
        (revnet.NotInvertibleError, jax.errors.JaxRuntimeError), match="non-finite"
    ):
        g = lambda x: f(x, zero)  # noqa: E731
        jax.block_until_ready(revnet.inverse(g, x)(g(x)))
    with pytest.raises(
        (revnet.NotInvertibleError, jax.errors.JaxRuntimeError), match="non-finite"
    ):
        g = jax.grad(lambda w: _loss(revnet.invertible(lambda x: f(x, w)))(x))
        jax.block_until_ready(g(jnp.float32(0.0)))


def test_checks_are_on_in_this_suite():
    assert os.environ.get("REVNET_RUNTIME_CHECKS") == "1"
    assert runtime_checks.enabled()


# --------------------------------------------------------------------------- #
# Invertible programs that were refused or crashed.


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_same_slice_written_twice(dtype):
    with jax.enable_x64(dtype == "float64"):
        w = _x(dtype, (2, 2), 1)

        def f(x):
            return jnp.concatenate([x[:, :2] + jnp.tanh(x[:, 2:] @ w), x[:, 2:]], -1)

        check_grads(f, _x(dtype), dtype=dtype)
        (gw, gx), (ww, wx) = _weights_grad(
            lambda w: (
                lambda x: jnp.concatenate(
                    [x[:, :2] + jnp.tanh(x[:, 2:] @ w), x[:, 2:]], -1
                )
            ),
            w,
            _x(dtype),
        )
        assert_trees_close((gw, gx), (ww, wx), tolerance(dtype), "grads")


def _scan_unused_ys(x):
    c, _ = revnet.scan(
        lambda c, _: (jnp.sinh(c) * 0.5 + 1.0, jnp.sum(c)), x, None, length=3
    )
    return c


def _lax_scan_unused_ys(x):
    c, _ = lax.scan(
        lambda c, _: (jnp.sinh(c) * 0.5 + 1.0, jnp.sum(c)), x, None, length=3
    )
    return c


def _nested_revnet_scans(x):
    def inner(c, _):
        return c * 1.25 - 0.25, c[0]

    def outer(c, _):
        c, _ = revnet.scan(inner, c, None, length=2)
        return jnp.arcsinh(c), jnp.mean(c)

    return revnet.scan(outer, x, None, length=3)[0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "f",
    [_scan_unused_ys, _lax_scan_unused_ys, _nested_revnet_scans],
    ids=["revnet.scan", "lax.scan", "nested revnet.scan"],
)
def test_scans_with_unused_ys(f, dtype):
    with jax.enable_x64(dtype == "float64"):
        check_grads(f, _x(dtype) * 0.3, dtype=dtype)


def test_nested_revnet_scan_inside_revnet_scan_gradients():
    x = _x("float32") * 0.3
    got = jax.grad(_loss(_nested_revnet_scans))(x)

    def plain(x):
        def outer(c, _):
            c, _ = lax.scan(lambda c, _: (c * 1.25 - 0.25, c[0]), c, None, length=2)
            return jnp.arcsinh(c), jnp.mean(c)

        return lax.scan(outer, x, None, length=3)[0]

    want = jax.grad(_loss(plain))(x)
    assert_trees_close(got, want, tolerance("float32"), "gradients")


@pytest.mark.parametrize("dtype", DTYPES)
def test_fori_loop_with_static_bounds(dtype):
    with jax.enable_x64(dtype == "float64"):
        w = _x(dtype, (5, 2, 2), 1) * 0.5

        def make(w):
            def f(x):
                def body(i, x):
                    lo, hi = x[:, :2], x[:, 2:]
                    lo = lo + jnp.tanh(hi @ w[i])
                    return jnp.concatenate([hi * 1.5, lo], -1)

                return lax.fori_loop(0, 5, body, x)

            return f

        check_grads(make(w), _x(dtype), dtype=dtype)
        got, want = _weights_grad(make, w, _x(dtype))
        assert_trees_close(got, want, tolerance(dtype), "grads")


@pytest.mark.parametrize(
    "xs,ms", [((0, 4), (4, 4)), ((2, 0), (0, 0)), ((0, 0), (0, 0))]
)
def test_zero_size_dot_general(xs, ms):
    m = jnp.ones(ms)
    f = revnet.invertible(lambda x: x @ m)
    x = jnp.ones(xs)
    assert jax.grad(lambda x: f(x).sum())(x).shape == xs
    assert revnet.inverse(lambda x: x @ m, x)(x @ m)[0].shape == xs


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_known_matrix(dtype):
    m = (jnp.eye(4) + 0.1 * _x("float32", (4, 4), 2)).astype(dtype)
    x = _x(dtype)
    check_grads(lambda x: x @ m, x, dtype=dtype)
    check_grads(lambda x: m @ x.T, x, dtype=dtype)


# --------------------------------------------------------------------------- #
# Clear errors.


def test_inverse_checks_output_shapes_and_dtypes():
    def f(x):
        return x * 2.0

    inv = revnet.inverse(f, jnp.ones((3, 4)))
    with pytest.raises(TypeError, match=r"output 0 should be float32\[3, 4\]") as e:
        inv(jnp.ones((4, 3)))
    assert "\n" not in str(e.value)
    with pytest.raises(TypeError, match="float32"):
        inv(jnp.ones((3, 4), jnp.int32))


def test_library_functions_are_blamed_on_the_users_line():
    def f(x):
        return jnp.cumprod(x)  # the line named in the error

    with pytest.raises(revnet.NotInvertibleError) as e:
        revnet.invertible(f)(jnp.ones(3))
    line = f.__code__.co_firstlineno + 1
    assert f"test_regressions.py:{line}" in str(e.value)
    assert "`cumprod`" in str(e.value)


def test_while_loop_inside_invertible_is_refused_with_a_reason():
    def f(x):
        return revnet.while_loop(
            lambda c: c[1] < 3, lambda c: (c[0] * 2.0, c[1] + 1), (x, 0)
        )[0]

    with pytest.raises(revnet.NotInvertibleError, match="trip count") as e:
        revnet.invertible(f)(jnp.ones(3))
    assert "revnet.scan" in str(e.value)


@pytest.mark.parametrize("loop", ["scan", "while_loop"])
def test_runtime_checks_in_revnet_loops(loop, checks_on):
    x = _x("float32")

    def run(w):
        body = lambda c: jnp.tanh(c) * w  # noqa: E731
        if loop == "scan":
            return revnet.scan(lambda c, _: (body(c), None), x, None, length=3)[0]
        return revnet.while_loop(
            lambda c: c[1] < 3, lambda c: (body(c[0]), c[1] + 1), (x, 0)
        )[0]

    g = jax.grad(lambda w: _loss(run)(w))
    with pytest.raises(
        (revnet.NotInvertibleError, jax.errors.JaxRuntimeError), match="non-finite"
    ):
        jax.block_until_ready(g(jnp.float32(0.0)))
    assert np.isfinite(g(jnp.float32(0.5)))


@jax.custom_vjp
def _ste_sign(x):
    return jnp.sign(x)


_ste_sign.defvjp(lambda x: (jnp.sign(x), None), lambda _, g: (g,))


@jax.custom_jvp
def _ste_round(x):
    return jnp.round(x)


_ste_round.defjvp(lambda p, t: (_ste_round(p[0]), t[0]))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("ste", [_ste_sign, _ste_round], ids=["vjp_sign", "jvp_round"])
@pytest.mark.parametrize("decisions", ["store", "recompute"])
def test_a_straight_through_estimator_in_f_passes_its_cotangent(ste, dtype, decisions):
    """A custom rule whose body has a zero derivative (``sign``, ``round``):
    the rule, not the body, says what a perturbation reaches (found by the
    fuzzer: the cotangent through ``ste(b)`` was dropped, in either mode)."""
    with jax.enable_x64(dtype == "float64"):
        w = jax.random.normal(jax.random.key(0), (4, 4), dtype) * 0.4
        a, b = (jax.random.normal(jax.random.key(k), (2, 4), dtype) for k in (1, 2))

        def f(w, a, b):
            return a + ste(b * 1.7) * jnp.tanh(b @ w) * 0.8, b

        def loss(g):
            return lambda *args: sum(jnp.sum(jnp.sin(y)) for y in g(*args))

        rev = revnet.invertible(f, known_argnums=0, decisions=decisions)
        got = jax.grad(loss(rev), (0, 1, 2))(w, a, b)
        want = jax.grad(loss(f), (0, 1, 2))(w, a, b)
        assert_trees_close(got, want, tolerance(dtype), "gradients")
