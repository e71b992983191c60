"""Tests of ``revnet.invertible`` and ``revnet.inverse``: gradients, composition,
memory and compute."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import revnet
from tests.helpers import (
    UNDER_CUSTOM_VJP3,
    assert_trees_close,
    check_against_autodiff,
    compiled,
    cotangents_like,
    flop_count,
    nondifferentiable,
    runtime_checks,
    temp_size,
    tolerance,
)


def _normal(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def _coupling_chain(weights):
    """An unrolled chain of additive couplings closing over ``weights``."""

    def net(x1, x2):
        for w in weights:
            x1 = x1 + jnp.tanh(x2 @ w[0])
            x2 = x2 + jax.nn.relu(x1 @ w[1])
        return x1, x2

    return net


def _loss(f):
    return lambda *a: sum(jnp.sum(jnp.sin(y)) for y in jax.tree_util.tree_leaves(f(*a)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.slow
def test_32_block_chain_gradients_every_input_and_weight(dtype):
    with jax.enable_x64(dtype == jnp.float64):
        d = 16
        ws = _normal(0, (32, 2, d, d), dtype) / np.sqrt(d) * 0.5
        x1, x2 = _normal(1, (8, d), dtype), _normal(2, (8, d), dtype)

        def loss(ws, x1, x2, f):
            return _loss(f(list(ws)))(x1, x2)

        plain = jax.grad(loss, (0, 1, 2))(ws, x1, x2, _coupling_chain)
        rev = jax.grad(loss, (0, 1, 2))(
            ws, x1, x2, lambda w: revnet.invertible(_coupling_chain(w))
        )
        rtol = tolerance(dtype)
        for name, a, e in zip(["weights", "x1", "x2"], rev, plain):
            assert_trees_close(a, e, rtol, name)


def _scan_net(weights):
    def net(x1, x2):
        def block(carry, w):
            a, b = carry
            y1 = a + jnp.tanh(b @ w[0])
            y2 = b + jnp.tanh(y1 @ w[1])
            return (y1, y2), None

        return jax.lax.scan(block, (x1, x2), weights)[0]

    return net


def test_scan_of_couplings_gradients_float64():
    with jax.enable_x64(True):
        ws = _normal(0, (12, 2, 8, 8), jnp.float64) * 0.3
        x = _normal(1, (4, 8), jnp.float64), _normal(2, (4, 8), jnp.float64)

        def loss(ws, x1, x2, rev):
            f = _scan_net(ws)
            return _loss(revnet.invertible(f) if rev else f)(x1, x2)

        g = jax.grad(loss, (0, 1, 2))(*(ws, *x), True)
        e = jax.grad(loss, (0, 1, 2))(*(ws, *x), False)
        assert_trees_close(g, e, tolerance(jnp.float64), "grads")


def test_closure_over_tracers_of_an_outer_grad_and_jit():
    ws = _normal(0, (4, 2, 8, 8)) * 0.3
    x1, x2 = _normal(1, (4, 8)), _normal(2, (4, 8))

    @jax.jit
    def rev_loss(ws, x1, x2):
        return _loss(revnet.invertible(_scan_net(ws)))(x1, x2)

    got = jax.grad(rev_loss, (0, 1, 2))(ws, x1, x2)
    want = jax.grad(lambda *a: _loss(_scan_net(a[0]))(*a[1:]), (0, 1, 2))(ws, x1, x2)
    assert_trees_close(got, want, tolerance(jnp.float32), "grads")


def test_pytree_arguments_and_outputs():
    w = _normal(3, (6, 6)) * 0.3

    def f(state, extra):
        a, b = state["a"], state["b"]
        a = a + jnp.tanh(b @ w)
        return {"pair": (b * 2.0, a), "e": jnp.exp(extra)}

    check_against_autodiff(
        f, {"a": _normal(1, (3, 6)), "b": _normal(2, (3, 6))}, _normal(4, (5,))
    )


def test_vmap_and_jit_compose():
    w = _normal(3, (6, 6)) * 0.3

    def f(a, b):
        return a + jnp.tanh(b @ w), b

    rf = revnet.invertible(f)
    xs = _normal(1, (5, 3, 6)), _normal(2, (5, 3, 6))
    loss = lambda g: lambda a, b: _loss(jax.vmap(g))(a, b)  # noqa: E731
    assert_trees_close(
        jax.jit(jax.grad(loss(rf), (0, 1)))(*xs),
        jax.grad(loss(f), (0, 1))(*xs),
        tolerance(jnp.float32),
    )
    assert_trees_close(
        jax.jit(jax.vmap(rf))(*xs), jax.vmap(f)(*xs), tolerance(jnp.float32, "values")
    )


def test_value_and_grad_and_vjp_agree():
    def f(a):
        return jnp.sinh(a) * 3.0 + 1.0

    x = _normal(0, (7,))
    v, g = jax.value_and_grad(lambda a: jnp.sum(revnet.invertible(f)(a) ** 2))(x)
    v0, g0 = jax.value_and_grad(lambda a: jnp.sum(f(a) ** 2))(x)
    assert_trees_close((v, g), (v0, g0), tolerance(jnp.float32))


@pytest.mark.parametrize("order", ["natural", "shuffled"])
def test_order_independence(order):
    """The same math with equations in a different order is accepted."""
    w1, w2 = _normal(3, (6, 6)) * 0.3, _normal(4, (6, 6)) * 0.3
    if order == "natural":

        def f(a, b):
            y1 = a + jnp.tanh(b @ w1)
            y2 = b + jnp.tanh(y1 @ w2)
            return y1, y2
    else:

        def f(a, b):
            hb = jnp.tanh(b @ w1)  # computed before it is needed
            y1 = hb + a
            t = y1 @ w2
            y2 = jnp.tanh(t) + b
            return y1, y2

    check_against_autodiff(f, _normal(1, (3, 6)), _normal(2, (3, 6)))


def test_integer_counter_gets_no_gradient():
    def f(i, x):
        return i + 1, x * 2.0 + jnp.float32(1.0)

    rf = revnet.invertible(f)
    i, x = jnp.array(3, jnp.int32), _normal(0, (4,))
    (j, y), vjp = jax.vjp(rf, i, x)
    assert int(j) == 4
    ci, cx = vjp(cotangents_like((j, y)))
    assert ci.dtype == jax.dtypes.float0
    np.testing.assert_allclose(
        cx, 2.0 * cotangents_like((j, y))[1], rtol=tolerance(jnp.float32, "values")
    )
    assert int(revnet.inverse(f, i, x)((j, y))[0]) == 3


def test_inverse_takes_shape_structs_and_decorated_functions():
    def f(a, b):
        return b, a * 3.0

    rf = revnet.invertible(f)
    a, b = _normal(0, (2, 3)), _normal(1, (4,))
    structs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (a, b)]
    for g in (f, rf):
        back = revnet.inverse(g, *structs)(f(a, b))
        assert isinstance(back, tuple)
        assert_trees_close(back, (a, b), tolerance(jnp.float32, "values"))
    # A single argument still gives a tuple.
    (only,) = revnet.inverse(lambda x: x + 1.0, a)(a + 1.0)
    assert_trees_close(only, a, tolerance(jnp.float32, "values"))


def test_inverse_rejects_wrong_output_structure():
    inv = revnet.inverse(lambda a, b: (a, b * 2.0), jnp.ones(2), jnp.ones(2))
    with pytest.raises(TypeError, match="expected outputs with structure"):
        inv(jnp.ones(2))


def test_analysis_is_cached_per_shape():
    calls = []

    def f(x):
        calls.append(1)
        return x * 2.0

    from revnet._engine import stats

    rf = revnet.invertible(f)
    before = stats["analyses"]
    rf(jnp.ones((3, 7)))
    rf(jnp.ones((3, 7)))
    n_same = len(calls)
    rf(jnp.ones((4, 7)))
    assert n_same == 2 and len(calls) == 3  # traced per call, analysed per shape
    assert stats["analyses"] - before == 2


@pytest.mark.skipif(
    UNDER_CUSTOM_VJP3, reason="JAX_CUSTOM_VJP3 raises its own forward-mode error"
)
def test_forward_mode_is_refused_clearly():
    """jax.jvp, jax.jacfwd and jax.linearize of an @invertible function or a
    revnet.scan: one line naming the call and what works, raised when the
    transformation is applied (not when a linearized function is first
    evaluated); jax.hessian (forward over reverse) is plain JAX's."""

    def coupling(a, b):
        a = a + jnp.tanh(b)
        return a, b + jnp.sin(a)

    rf = revnet.invertible(coupling)

    def scanned(c):
        return revnet.scan(lambda c, _: (coupling(*c), None), (c, c), None, length=3)

    x = jnp.linspace(-1.0, 1.0, 3)
    for name, fn in [("revnet.invertible(coupling)", rf), ("revnet.scan", scanned)]:
        args = (x, x) if fn is rf else (x,)
        for transform in (
            lambda: jax.jvp(fn, args, args),
            lambda: jax.jacfwd(fn)(*args),
            lambda: jax.linearize(fn, *args),
        ):
            with pytest.raises(TypeError, match="reverse mode only") as e:
                transform()
            assert str(e.value).startswith(name), str(e.value)
            assert "\n" not in str(e.value)

    def loss(c):
        return jnp.sum(rf(c, 2.0 * c)[1] ** 2)

    def plain(c):
        return jnp.sum(coupling(c, 2.0 * c)[1] ** 2)

    assert_trees_close(
        jax.hessian(loss)(x), jax.hessian(plain)(x), tolerance("float32"), "hessian"
    )


@pytest.mark.skipif(
    UNDER_CUSTOM_VJP3, reason="JAX_CUSTOM_VJP3 raises its own forward-mode error"
)
def test_forward_over_reverse_with_a_stored_decision_is_refused_in_one_line():
    """A stored decision is replayed by a custom VJP, which forward over
    reverse cannot differentiate: jax.hessian says so, in one line, rather
    than claiming that forward mode was applied to the call alone."""

    def coupling(jump):
        return lambda a, b: (a + jump(b) * jnp.tanh(b), b)

    def loss(f):
        return lambda c: jnp.sum(f(c, 2.0 * c)[0] ** 2)

    x = jnp.linspace(-1.0, 1.0, 3) + 0.1
    # A stored rounded value is a constant of the backward pass: exact.
    stored = revnet.invertible(coupling(jnp.round))
    want = jax.hessian(loss(coupling(jnp.round)))(x)
    assert_trees_close(jax.hessian(loss(stored))(x), want, tolerance("float32"))
    # rem is replayed at its stored inputs, by a custom VJP.
    at_point = revnet.invertible(coupling(lambda b: jnp.mod(b, 0.5)))
    with pytest.raises(TypeError, match="forward over reverse reached") as e:
        jax.hessian(loss(at_point))(x)
    assert "\n" not in str(e.value)


def test_rejects_non_array_arguments():
    with pytest.raises(TypeError, match="pytrees of arrays"):
        revnet.invertible(lambda x: x)("not an array")


# --------------------------------------------------------------------------- #
# Memory and compute, from the compiled program.


def _compiled(n_steps, reversible, width=128, batch=256, checks=False):
    ws = jnp.full((n_steps, 2, width, width), 0.01)
    x = jnp.ones((batch, width))

    def loss(ws, x1, x2):
        f = _scan_net(ws)
        return _loss(revnet.invertible(f) if reversible else f)(x1, x2)

    with runtime_checks(checks):
        return compiled(jax.grad(loss, (0, 1, 2)), ws, x, x)


def test_memory_flat_in_depth_while_autodiff_grows():
    rev = [temp_size(_compiled(n, True)) for n in (8, 64)]
    std = [temp_size(_compiled(n, False)) for n in (8, 64)]
    assert rev[1] <= 1.10 * rev[0], f"reversible temp memory grew: {rev}"
    assert std[1] >= 4 * std[0], f"plain autodiff did not grow as expected: {std}"
    assert std[1] >= 10 * rev[1]


def test_flops_within_four_thirds_of_backprop():
    # cost_analysis counts a scan body once: compare scans of the same length.
    rev = flop_count(_compiled(8, True))
    std = flop_count(_compiled(8, False))
    assert rev <= 1.40 * std, f"reversible/standard FLOPs = {rev / std:.3f}"


def test_runtime_checks_keep_memory_flat_and_cost_little():
    rev = [temp_size(_compiled(n, True, checks=True)) for n in (8, 64)]
    assert rev[1] <= 1.10 * rev[0], f"reversible temp memory grew: {rev}"
    on = flop_count(_compiled(8, True, checks=True))
    off = flop_count(_compiled(8, True))
    assert off < on <= 1.05 * off, f"checks on/off FLOPs = {on / off:.4f}"


def test_closed_over_keys_replay_dropout_exactly():
    """Dropout masks drawn from a closed-over key are the same in the backward."""
    w = _normal(3, (8, 8)) * 0.3
    x = _normal(1, (4, 8))

    def loss(w, a, b, key, reversible):
        def f(a, b):
            keep = jax.random.bernoulli(key, 0.7, b.shape)
            return a + jnp.where(keep, jnp.tanh(b @ w) / 0.7, 0.0), b

        y1, y2 = (revnet.invertible(f) if reversible else f)(a, b)
        return jnp.sum(jnp.sin(y1)) + jnp.sum(y2 * y1)

    keys = jax.random.split(jax.random.key(0), 3)
    grad = jax.vmap(jax.grad(loss, (0, 1, 2)), (None, None, None, 0, None))
    got = jax.jit(grad, static_argnums=4)(w, x, x, keys, True)
    assert_trees_close(got, grad(w, x, x, keys, False), tolerance(jnp.float32))


# --------------------------------------------------------------------------- #
# Regressions.


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_inverse_accepts_python_scalar_outputs(dtype):
    with jax.enable_x64(dtype == jnp.float64):

        def f(x, k):
            return 2.0 * x + jnp.sin(k), k + 1

        x, k = jnp.asarray(0.75, dtype), jnp.int32(4)
        y, j = f(x, k)
        inv = revnet.inverse(f, x, k)
        rtol = tolerance(dtype, "values")
        for given in [(float(y), int(j)), (float(y), j), (y, int(j))]:
            got = inv(given)
            assert [a.dtype for a in got] == [jnp.dtype(dtype), jnp.dtype("int32")]
            assert_trees_close(got, (x, k), rtol, "inverse")
        # A Python int for a float output, as in ``x + 1``.
        got = inv((1, j))
        assert got[0].dtype == dtype
        assert_trees_close(got, inv((jnp.ones((), dtype), j)), rtol, "inverse")
        with pytest.raises(TypeError, match=r"output 1 should be int32\[\]"):
            inv((float(y), 5.5))  # JAX would not make 5.5 an int32 either


def test_invertible_of_a_custom_ivjp_function_uses_its_inverse():
    calls = []

    @revnet.custom_ivjp
    def g(x):
        return 2.0 * x + 1.0

    @g.definverse
    def _(y):
        calls.append(1)
        return (y - 1.0) / 2.0

    for dtype in [jnp.float32, jnp.float64]:
        with jax.enable_x64(dtype == jnp.float64):
            x = jnp.linspace(-1.0, 1.0, 5, dtype=dtype)
            for wrapped in [revnet.invertible(g), revnet.invertible(lambda x: g(x))]:
                calls.clear()
                got = jax.grad(lambda x: jnp.sum(jnp.sin(wrapped(x))))(x)
                want = jax.grad(lambda x: jnp.sum(jnp.sin(2.0 * x + 1.0)))(x)
                assert calls, "the user's inverse was not called"
                assert_trees_close(got, want, tolerance(dtype))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_invertible_does_not_differentiate_unperturbed_inputs(dtype):
    def f(h, k):  # k is not differentiated: the guard sees no tangent
        return h * 2.0 + jnp.tanh(nondifferentiable(k)), k

    with jax.enable_x64(dtype == jnp.float64):
        h, k = jnp.linspace(-0.5, 0.5, 3, dtype=dtype), jnp.full(3, 0.3, dtype)
        loss = lambda f: lambda h, k: jnp.sum(jnp.sin(f(h, k)[0]))  # noqa: E731
        got = jax.grad(loss(revnet.invertible(f)))(h, k)
        assert_trees_close(got, jax.grad(loss(f))(h, k), tolerance(dtype))
