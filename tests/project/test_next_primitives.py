"""revnet under JAX's next primitives: JAX_CUSTOM_VJP3, JAX_REMAT3, JAX_SCAN3.

Each flag reroutes ``jax.custom_vjp``, ``jax.checkpoint`` or ``lax.scan`` to a
hijax ``call_hi_primitive`` (``Scan3`` also makes carry refs: ``new_ref``,
``get``, ``swap``). The flags are read when a function is wrapped (custom_vjp,
checkpoint) or called (scan), so each test turns its flag on with
``jax.config.update`` for its own duration, builds its functions inside, and
checks in ``jax.make_jaxpr`` that the hijax primitive is really there.

Gradients are compared elementwise with plain ``jax.grad`` of the same
function under the same flag. Plain ``jax.grad`` of a ``lax.scan`` fails under
JAX_SCAN3 in jax 0.10.2 ("Scan3 must implement `vjp_fwd`"): that comparison is
skipped with JAX's message, and a separate test compares with plain ``jax.grad``
of the same function with the flag off.
"""

from __future__ import annotations

import contextlib

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import revnet
from revnet import blocks
from revnet._engine import jaxpr as jx
from tests.helpers import assert_trees_close, primitives, tolerance

FLAGS = ("jax_custom_vjp3", "jax_remat3", "jax_scan3")
DTYPES = (jnp.float32, jnp.float64)


@contextlib.contextmanager
def flag(name: str, on: bool = True):
    """Sets the JAX flag ``name`` inside the block, and restores it."""
    before = getattr(jax.config, name)
    jax.config.update(name, on)
    try:
        yield
    finally:
        jax.config.update(name, before)


@contextlib.contextmanager
def dtype_scope(dtype):
    with jax.enable_x64(dtype == jnp.float64):
        yield


def plain_grad_or_skip(loss, args, why: str):
    """``jax.grad(loss)(*args)``, or a skip with JAX's own message."""
    try:
        return jax.grad(loss, argnums=tuple(range(len(args))))(*args)
    except NotImplementedError as e:
        pytest.skip(
            f"plain JAX {jax.__version__} fails under {why}: {str(e).splitlines()[0]}"
        )


def normal(seed, shape, dtype):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, dtype)


def sum_sq(tree):
    return sum(jnp.sum(jnp.sin(o)) for o in jax.tree_util.tree_leaves(tree))


def check(fun, args, flag_name: str):
    """Values, inverse and gradients of ``invertible(fun)`` against plain JAX."""
    rtol = tolerance(args[0].dtype) * 10
    inv = revnet.invertible(fun)
    out = fun(*args)
    assert_trees_close(inv(*args), out, rtol, "output")
    back = revnet.inverse(fun, *args)(out)
    assert_trees_close(back, tuple(args), rtol, "inverse")
    grads = jax.grad(lambda *a: sum_sq(inv(*a)), argnums=(0, 1))(*args)
    want = plain_grad_or_skip(lambda *a: sum_sq(fun(*a)), args, flag_name)
    assert_trees_close(grads, want, rtol, "gradient")


# -- the programs --------------------------------------------------------------- #


def weights(dtype, n=3):
    return normal(7, (n, 4, 4), dtype) * 0.4


def custom_vjp_coupling(dtype):
    @jax.custom_vjp
    def act(x):
        return jnp.tanh(x)

    act.defvjp(lambda x: (jnp.tanh(x), x), lambda x, g: ((1 - jnp.tanh(x) ** 2) * g,))
    w = weights(dtype)

    def f(x1, x2):
        y1 = x1 + act(x2 @ w[0])
        y2 = x2 + act(y1 @ w[1])
        return y1, y2

    return f


def custom_ivjp_coupling(dtype):
    scale = revnet.custom_ivjp(lambda x: 2.0 * x + 1.0)
    scale.definverse(lambda y: (y - 1.0) / 2.0)
    w = weights(dtype)

    def f(x1, x2):
        y1 = scale(x1) + jnp.tanh(x2 @ w[0])
        y2 = x2 + jnp.tanh(y1 @ w[1])
        return y1, y2

    return f


def checkpoint_coupling(dtype):
    w = weights(dtype)

    @jax.checkpoint
    def F(x):  # noqa: N802 - the coupling's F
        return jax.checkpoint(jnp.tanh)(x @ w[0])

    def f(x1, x2):
        y1 = jax.checkpoint(lambda a, b: a + F(b))(x1, x2)
        y2 = x2 + jnp.tanh(y1 @ w[1])
        return y1, y2

    return f


def scan_stack(dtype):
    w = weights(dtype)

    def f(x1, x2):
        def body(c, wi):
            a, b = c
            a = a + jnp.tanh(b @ wi)
            b = b + jnp.tanh(a @ wi)
            return (a, b), jnp.sum(a)

        (a, b), ys = jax.lax.scan(body, (x1, x2), w)
        return a, b, ys

    return f


PROGRAMS = {
    "custom_vjp": (custom_vjp_coupling, "custom_vjp_call"),
    "custom_ivjp": (custom_ivjp_coupling, "custom_vjp_call"),
    "checkpoint": (checkpoint_coupling, "remat2"),
    "scan": (scan_stack, "scan"),
}
# Which program each flag reroutes: its classic primitive must be gone.
REROUTES = {
    "jax_custom_vjp3": ("custom_vjp", "custom_ivjp"),
    "jax_remat3": ("checkpoint",),
    "jax_scan3": ("scan",),
}


def inputs(dtype):
    return normal(1, (2, 4), dtype), normal(2, (2, 4), dtype) * 0.5


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("program", sorted(PROGRAMS))
@pytest.mark.parametrize("flag_name", FLAGS)
@pytest.mark.slow
def test_inverted_path_under_flag(flag_name, program, dtype):
    make, classic = PROGRAMS[program]
    with flag(flag_name), dtype_scope(dtype):
        f, args = make(dtype), inputs(dtype)
        names = primitives(f, *args)
        if program in REROUTES[flag_name]:
            assert "call_hi_primitive" in names and classic not in names, names
        check(f, args, flag_name)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_scan_under_scan3_against_unflagged_jax(dtype):
    # Plain jax.grad cannot differentiate Scan3; compare with the same function
    # traced without the flag.
    with dtype_scope(dtype):
        args = inputs(dtype)

        def loss(*a):
            return sum_sq(scan_stack(dtype)(*a))

        want = jax.grad(loss, argnums=(0, 1))(*args)
        with flag("jax_scan3"):
            assert "new_ref" in primitives(scan_stack(dtype), *args)
            f = revnet.invertible(scan_stack(dtype))
            got = jax.grad(lambda *a: sum_sq(f(*a)), argnums=(0, 1))(*args)
            with pytest.raises(NotImplementedError, match="vjp_fwd"):
                jax.grad(loss)(*args)
    assert_trees_close(got, want, tolerance(dtype) * 10, "gradient")


def test_reverse_scan3_is_refused_with_the_reason():
    # jax 0.10.2's Scan3 ignores reverse=True: its values are not lax.scan's.
    def f(x):
        return jax.lax.scan(
            lambda c, w: (c * 0.5 - w, c), x, jnp.arange(3.0), reverse=True
        )

    with flag("jax_scan3"):
        assert "new_ref" in primitives(f, jnp.ones(2))
        with pytest.raises(revnet.NotInvertibleError, match="ignores reverse"):
            revnet.invertible(f)(jnp.ones(2))


@pytest.mark.parametrize("reverse", [False, True])
def test_internal_scan_is_lax_scan_under_scan3(reverse):
    def body(c, x):
        return c * 0.9 + x, c

    xs = jnp.arange(5.0)
    want = jax.lax.scan(body, 1.0, xs, reverse=reverse)
    want_grad = jax.grad(lambda x: jax.lax.scan(body, x, xs, reverse=reverse)[0])(1.0)
    with flag("jax_scan3"):
        got = jx.scan(body, 1.0, xs, reverse=reverse)
        got_grad = jax.grad(lambda x: jx.scan(body, x, xs, reverse=reverse)[0])(1.0)
        assert "scan" in primitives(lambda x: jx.scan(body, x, xs), 1.0)
    rtol = tolerance(jnp.float32, "values")  # the same linear scan
    assert_trees_close(got, want, rtol)
    np.testing.assert_allclose(got_grad, want_grad, rtol=rtol)


def test_plans_of_different_custom_vjp3_bodies_are_not_shared():
    # call_hi_primitive's one param is an object: the plan cache must key on
    # its body, or the second function would run the first one's plan.
    with flag("jax_custom_vjp3"):

        @jax.custom_vjp
        def affine(x):
            return 2.0 * x + 1.0

        affine.defvjp(lambda x: (affine(x), None), lambda _, c: (2.0 * c,))

        @jax.custom_vjp
        def expm1(x):
            return jnp.exp(x) - 1.0

        expm1.defvjp(lambda x: (expm1(x), x), lambda x, c: (jnp.exp(x) * c,))
        x = jnp.linspace(-1.0, 1.0, 4)
        for g in (affine, expm1):
            assert "call_hi_primitive" in primitives(g, x)
            back = revnet.inverse(g, x)(g(x))[0]
            np.testing.assert_allclose(
                back,
                x,
                rtol=tolerance(jnp.float32, "round_trip"),
                atol=1e-6,  # tighter than the round trip's: one operation
            )


# -- revnet's own loops and custom VJPs ----------------------------------------- #


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("flag_name", FLAGS)
def test_revnet_while_loop_under_flag(flag_name, dtype):
    with flag(flag_name), dtype_scope(dtype):
        w = weights(dtype)
        x = normal(3, (2, 4), dtype)

        @jax.checkpoint
        def wbody(c):
            i, a, b = c
            return i + 1, a + jnp.tanh(b @ w[0]), b

        def looped(x):
            _, a, _ = revnet.while_loop(lambda c: c[0] < 3, wbody, (0, x, x * 0.5))
            return jnp.sum(jnp.sin(a))

        def unrolled(x):
            c = (0, x, x * 0.5)
            for _ in range(3):
                c = wbody(c)
            return jnp.sum(jnp.sin(c[1]))

        rtol = tolerance(dtype) * 10
        assert_trees_close(jax.grad(looped)(x), jax.grad(unrolled)(x), rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("flag_name", FLAGS)
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.slow
def test_revnet_scan_under_flag(reverse, flag_name, dtype):
    def run(scan, x, w):
        @jax.checkpoint
        def step(c, wi):
            a, b = c
            return (b, a + jnp.tanh(b @ wi)), jnp.sum(a)

        (a, b), ys = scan(step, (x, x * 0.5), w, reverse=reverse)
        return jnp.sum(jnp.sin(a)) + jnp.sum(b**2) + jnp.sum(ys * ys)

    with dtype_scope(dtype):
        w, x = weights(dtype, 4), normal(3, (2, 4), dtype)
        unflagged = jax.grad(run, argnums=(1, 2))(jax.lax.scan, x, w)
        with flag(flag_name):
            got = jax.grad(run, argnums=(1, 2))(revnet.scan, x, w)
        rtol = tolerance(dtype) * 10
        assert_trees_close(got, unflagged, rtol, "gradient vs unflagged JAX")
        with flag(flag_name):
            want = plain_grad_or_skip(
                lambda x, w: run(jax.lax.scan, x, w), (x, w), flag_name
            )
        assert_trees_close(got, want, rtol, "gradient")


@pytest.mark.parametrize("flag_name", FLAGS)
def test_revnet_custom_vjps_are_hijax_and_recognised(flag_name):
    # revnet's own custom VJPs (custom_ivjp, the loops) are jax.custom_vjp: under
    # JAX_CUSTOM_VJP3 they are call_hi_primitive, and still solved by their tag.
    # One scale per flag: revnet.scan reuses a traced forward by a key that
    # ignores custom VJP rules, so another custom_ivjp with the same forward
    # would be served the first one's equation (and inverse).
    k = 2.0 + FLAGS.index(flag_name)
    with flag(flag_name):
        double = revnet.custom_ivjp(lambda x: k * x)
        calls = []

        @double.definverse
        def _(y):
            calls.append(1)
            return y / k

        def f(x):
            y, _ = revnet.scan(lambda c, _: (double(c), None), x, length=3)
            return y

        x = jnp.arange(3.0)
        names = primitives(f, x)
        hijax = flag_name == "jax_custom_vjp3"
        assert ("call_hi_primitive[CustomVJPTraced]" in names) == hijax, names
        np.testing.assert_allclose(revnet.inverse(f, x)(f(x))[0], x)
        assert calls  # solved by the user's inverse, not through its body
        g = jax.grad(lambda x: jnp.sum(revnet.invertible(f)(x) ** 2))(x)
        want = 2 * k**3 * f(x)  # a linear map's gradient
        np.testing.assert_allclose(g, want, rtol=tolerance(jnp.float32, "values"))


# -- Haiku blocks --------------------------------------------------------------- #


def mlp(h):
    return hk.Linear(4)(jnp.tanh(hk.Linear(8)(h)))


def sequence(reversible):
    def net(x):
        block = lambda h: blocks.AdditiveCoupling(mlp, mlp)(h)  # noqa: E731
        return blocks.ReversibleSequence(block, 3, reversible=reversible)(x)

    return hk.without_apply_rng(hk.transform(net))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("flag_name", FLAGS)
@pytest.mark.parametrize("reference", ["flagged", "unflagged"])
@pytest.mark.slow
def test_reversible_sequence_under_flag(reference, flag_name, dtype):
    """The Haiku stack (a lax.scan over stacked parameters inside ONE
    invertible function) against its plain twin, with the flag on or off."""
    with dtype_scope(dtype):
        x = normal(4, (5, 8), dtype)
        rev, twin = sequence(True), sequence(False)
        params = rev.init(jax.random.PRNGKey(0), x)
        params = jax.tree.map(lambda a: a.astype(dtype), params)

        def loss(model):
            return lambda p, x: sum_sq(model.apply(p, x))

        if reference == "unflagged":
            want = jax.grad(loss(twin), argnums=(0, 1))(params, x)
        with flag(flag_name):
            if flag_name == "jax_scan3":  # the twin's scan is Scan3 now
                assert "new_ref" in primitives(twin.apply, params, x)
            if flag_name == "jax_custom_vjp3":  # and revnet's own custom VJP
                assert "call_hi_primitive" in primitives(rev.apply, params, x)
            got = jax.grad(loss(rev), argnums=(0, 1))(params, x)
            y = rev.apply(params, x)
            if reference == "flagged":
                want = plain_grad_or_skip(loss(twin), (params, x), flag_name)
        rtol = tolerance(dtype) * 10
        assert_trees_close(y, twin.apply(params, x), rtol, "output")
        assert_trees_close(got, want, rtol, "gradient")
