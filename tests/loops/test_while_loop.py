"""Tests for ``revnet.while_loop`` (and the errors, bad arguments and
regressions of both loops).

Every gradient is compared with ``jax.grad`` of the same loop written with
``lax.scan`` over the known number of steps, elementwise, for every input and
every closed-over parameter. Memory and compute claims are checked on compiled
programs (``memory_analysis``, ``cost_analysis``), never on wall time.
"""

from __future__ import annotations

import functools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

from revnet import NotInvertibleError
from revnet._engine.loops.hooks import backward_steps, modes_chosen
from revnet.loops import scan, while_loop
from tests.helpers import (
    UNDER_CUSTOM_VJP3,
    UNDER_SCAN3,
    assert_trees_close,
    flop_count,
    nondifferentiable,
    temp_size,
    tolerance,
)
from tests.loops.programs import (
    compiled_grad,
    coupling_step,
    loss_scan_ref,
    loss_while,
    make_inputs,
    make_params,
    memory_setup,
    readout,
)

# Every example compiles a new program (~1 s on 2 cores): a third of the
# profile's examples, but at least 8, keeps the file near a minute.
_FEW = settings(max_examples=max(8, settings.default.max_examples // 3))


# --------------------------------------------------------------------------- #
# while_loop: gradients.


def _while_loss_to(p, x1, x2, n):
    """Stops when the counter reaches ``n``, a traced (closed-over) value."""
    return loss_while(p, x1, x2, lambda c: c[2] < n, max_steps=100)[0]


_while_vg = jax.jit(jax.value_and_grad(_while_loss_to, argnums=(0, 1, 2)))
_ref_vg = jax.jit(
    jax.value_and_grad(loss_scan_ref, argnums=(0, 1, 2)), static_argnums=3
)


@_FEW
@given(
    d=st.integers(1, 4),
    batch=st.integers(1, 2),
    n=st.integers(0, 12),
    f64=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_while_gradients_equal_scan_reference(d, batch, n, f64, seed):
    dtype = jnp.float64 if f64 else jnp.float32
    with jax.enable_x64(f64):
        p = make_params(seed, d, dtype)
        x1, x2 = make_inputs(seed, batch, d, dtype)
        got = _while_vg(p, x1, x2, jnp.int32(n))
        want = _ref_vg(p, x1, x2, n)
        assert_trees_close(got, want, tolerance(dtype), floor=0.0, exact_dtypes=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_while_data_dependent_stopping(dtype):
    """``cond_fun`` reads the carry; the gradient is that of the steps taken."""
    with jax.enable_x64(dtype == jnp.float64):
        p = make_params(3, 5, dtype)
        x1, x2 = make_inputs(3, 2, 5, dtype)

        def cond(c):
            return jnp.sum(c[0] ** 2) < 60.0

        (val, n), grads = jax.jit(
            jax.value_and_grad(
                lambda *a: loss_while(*a, cond), argnums=(0, 1, 2), has_aux=True
            )
        )(p, x1, x2)
        # The trip count, from an independent loop over NumPy values.
        step = jax.jit(coupling_step)
        y1, y2, m = x1, x2, 0
        while np.sum(np.asarray(y1) ** 2) < 60.0:
            y1, y2 = step(p, y1, y2)
            m += 1
        assert int(n) == m and m > 3
        want = _ref_vg(p, x1, x2, m)
        assert_trees_close(
            (val, grads), want, tolerance(dtype), floor=0.0, exact_dtypes=True
        )


def test_while_max_steps_bounds_the_loop():
    p = make_params(0, 3, jnp.float32)
    x1, x2 = make_inputs(0, 1, 3, jnp.float32)
    loss = jax.jit(lambda p, x1, x2: loss_while(p, x1, x2, lambda c: True, max_steps=7))
    (_, n), g = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(p, x1, x2)
    assert int(n) == 7
    assert_trees_close(
        g,
        jax.grad(loss_scan_ref, argnums=(0, 1, 2))(p, x1, x2, 7),
        tolerance(jnp.float32),
        floor=0.0,
        exact_dtypes=True,
    )
    # max_steps=0 is the identity, with an identity gradient.
    (_, n0), g0 = jax.value_and_grad(
        lambda x: loss_while(p, x, x2, lambda c: True, max_steps=0), has_aux=True
    )(x1)
    assert int(n0) == 0
    np.testing.assert_array_equal(g0, jax.grad(readout)(x1, x2))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_while_vmap_per_element_trip_counts(dtype):
    """Elements stop at different steps; each gets its own exact gradient."""
    rtol = tolerance(dtype)
    with jax.enable_x64(dtype == jnp.float64):
        p = make_params(7, 4, dtype)
        x1, x2 = make_inputs(7, 6, 4, dtype)  # the batch axis is the vmapped one
        x1 = x1 * jnp.linspace(0.2, 2.0, 6, dtype=dtype)[:, None]
        tols = jnp.linspace(8.0, 30.0, 6, dtype=dtype)  # batched cond constant

        def loss(p, x1, x2, tol):
            return loss_while(
                p, x1, x2, lambda c: jnp.sum(c[0] ** 2) < tol, max_steps=500
            )

        grad = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)
        g, ns = jax.jit(jax.vmap(grad, (None, 0, 0, 0)))(p, x1, x2, tols)
        ns = [int(n) for n in ns]
        assert len(set(ns)) >= 3, ns
        # grad of a batched sum: the weights' gradient sums over elements.
        g_sum = jax.jit(
            jax.grad(
                lambda p: jnp.sum(jax.vmap(loss, (None, 0, 0, 0))(p, x1, x2, tols)[0])
            )
        )(p)
        alone = jax.jit(loss)
        want_sum = jax.tree_util.tree_map(jnp.zeros_like, p)
        for e, n in enumerate(ns):
            assert int(alone(p, x1[e], x2[e], tols[e])[1]) == n  # same trip count
            _, want = _ref_vg(p, x1[e], x2[e], n)
            assert_trees_close(
                jax.tree_util.tree_map(lambda a: a[e], g),
                want,
                rtol,
                floor=0.0,
                exact_dtypes=True,
            )
            want_sum = jax.tree_util.tree_map(jnp.add, want_sum, want[0])
        assert_trees_close(g_sum, want_sum, rtol, floor=0.0, exact_dtypes=True)


def test_while_jit_equals_eager_and_values_equal_lax():
    p = make_params(1, 4, jnp.float32)
    x1, x2 = make_inputs(1, 3, 4, jnp.float32)

    def run(p, x1, x2):
        def body(c):
            return (*coupling_step(p, c[0], c[1]), c[2] + 1)

        return while_loop(lambda c: jnp.sum(c[0] ** 2) < 40.0, body, (x1, x2, 0))

    def lax_run(p, x1, x2):
        def body(c):
            return (*coupling_step(p, c[0], c[1]), c[2] + 1)

        return lax.while_loop(lambda c: jnp.sum(c[0] ** 2) < 40.0, body, (x1, x2, 0))

    eager = run(p, x1, x2)
    jitted = jax.jit(run)(p, x1, x2)
    for a, b, c in zip(eager, jitted, jax.jit(lax_run)(p, x1, x2)):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    loss = lambda *a: readout(*run(*a)[:2])  # noqa: E731
    assert_trees_close(
        jax.grad(loss, argnums=(0, 1, 2))(p, x1, x2),
        jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(p, x1, x2),
        tolerance(jnp.float32, "values"),  # the same gradient, jitted
        floor=0.0,
        exact_dtypes=True,
    )


def test_while_pytree_carry_with_integer_and_float_time():
    """Dict carry; an int counter and a float clock; ints get float0 grads."""
    p = make_params(2, 3, jnp.float32)
    x1, x2 = make_inputs(2, 2, 3, jnp.float32)

    def body(c):
        y1, y2 = coupling_step(p, c["x"][0], c["x"][1])
        return {"x": (y1, y2), "i": c["i"] + 1, "t": c["t"] + p["dt"]}

    def run(x1, x2, i0):
        init = {"x": (x1, x2), "i": i0, "t": jnp.float32(0.0)}
        return while_loop(lambda c: c["t"] < 2.0, body, init, max_steps=50)

    out = run(x1, x2, jnp.int32(5))
    n = int(out["i"]) - 5
    assert n == int(np.ceil(2.0 / 0.3)) and out["i"].dtype == jnp.int32
    g1, g2, gi = jax.grad(
        lambda *a: readout(*run(*a)["x"]), argnums=(0, 1, 2), allow_int=True
    )(x1, x2, jnp.int32(5))
    assert gi.dtype == jax.dtypes.float0
    want = jax.grad(loss_scan_ref, argnums=(1, 2))(p, x1, x2, n)
    rtol = tolerance(jnp.float32)
    assert_trees_close((g1, g2), want, rtol, floor=0.0, exact_dtypes=True)


def test_while_gradient_of_closed_over_step_size_and_haiku_params():
    """A weight-tied Haiku block iterated until a tolerance; params get grads."""

    def half(x):
        return jnp.tanh(hk.Linear(4, name="f")(x))

    f = hk.without_apply_rng(hk.transform(half))
    g = hk.without_apply_rng(hk.transform(half))
    x1, x2 = make_inputs(4, 3, 4, jnp.float32)
    pf = f.init(jax.random.PRNGKey(0), x2)
    pg = g.init(jax.random.PRNGKey(1), x1)

    def step(params, x1, x2):
        pf, pg, h = params
        x1 = x1 + h * f.apply(pf, x2)
        x2 = x2 + h * g.apply(pg, x1)
        return x1, x2

    def loss(params, x1, x2):
        def body(c):
            return (*step(params, c[0], c[1]), c[2] + 1)

        y1, y2, n = while_loop(
            lambda c: jnp.max(jnp.abs(c[1])) < 3.0, body, (x1, x2, 0), max_steps=1000
        )
        return readout(y1, y2), n

    params = (pf, pg, jnp.float32(0.25))
    (_, n), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
        params, x1, x2
    )
    n = int(n)
    assert 2 < n < 1000

    def ref(params, x1, x2):
        (y1, y2), _ = lax.scan(
            lambda c, _: (step(params, *c), None), (x1, x2), None, length=n
        )
        return readout(y1, y2)

    assert_trees_close(
        grads,
        jax.grad(ref, argnums=(0, 1, 2))(params, x1, x2),
        tolerance(jnp.float32),
        floor=0.0,
        exact_dtypes=True,
    )


def test_while_closes_over_keys_ints_and_batched_step_sizes():
    """Closed-over keys and ints get float0 cotangents; a vmapped step size works."""
    p = make_params(6, 3, jnp.float32)
    x1, x2 = make_inputs(6, 2, 3, jnp.float32)
    key = jax.random.PRNGKey(3)
    shift = jnp.arange(3)  # an integer array used forward only

    def step(p, dt, x1, x2):
        noise = 0.1 * jax.random.normal(key, x1.shape)
        x1 = x1 + dt * jnp.tanh(x2 @ p["w1"] + noise + shift)
        x2 = x2 + dt * jnp.tanh(x1 @ p["w2"])
        return x1, x2

    def loss(p, dt, x1, x2):
        def body(c):
            return (*step(p, dt, c[0], c[1]), c[2] + 1)

        y1, y2, _ = while_loop(lambda c: c[2] < 5, body, (x1, x2, 0))
        return readout(y1, y2)

    def ref(p, dt, x1, x2):
        (y1, y2), _ = lax.scan(
            lambda c, _: (step(p, dt, *c), None), (x1, x2), None, length=5
        )
        return readout(y1, y2)

    dts = jnp.array([0.1, 0.2, 0.3])
    argnums = (0, 1, 2, 3)
    got = jax.vmap(jax.grad(loss, argnums), (None, 0, None, None))(p, dts, x1, x2)
    want = jax.vmap(jax.grad(ref, argnums), (None, 0, None, None))(p, dts, x1, x2)
    rtol = tolerance(jnp.float32)
    assert_trees_close(got, want, rtol, floor=0.0, exact_dtypes=True)


# --------------------------------------------------------------------------- #
# while_loop: memory and cost.


def _while_loss(bound, stop):
    return lambda p, x1, x2: loss_while(
        p, x1, x2, lambda c: c[2] < stop, max_steps=bound
    )[0]


def test_while_memory_is_flat_in_steps_while_lax_scan_grows():
    p, x1, x2 = memory_setup()

    def temp(loss):
        return temp_size(compiled_grad(loss, p, x1, x2))

    ours = {n: temp(_while_loss(n, n)) for n in (8, 1024)}
    ref = {
        n: temp(lambda p, x1, x2, n=n: loss_scan_ref(p, x1, x2, n)) for n in (8, 1024)
    }
    assert ours[1024] <= 1.1 * ours[8], ours
    # lax.scan stores each step's carry and activations: it grows ~linearly.
    assert ref[1024] >= 50 * ref[8], ref
    assert ours[1024] * 100 < ref[1024]


def test_while_backward_cost_follows_steps_taken():
    """Bound 1024 stopping after 8 steps costs what bound 8 does."""
    p, x1, x2 = memory_setup()
    c8 = compiled_grad(_while_loss(8, 8), p, x1, x2)
    c1024 = compiled_grad(_while_loss(1024, 8), p, x1, x2)
    f8, f1024 = flop_count(c8), flop_count(c1024)
    # cost_analysis counts a loop body once: the per-step bodies are the same.
    assert abs(f1024 - f8) <= 1e-4 * f8, (f8, f1024)  # FLOP counts, not values
    # And the fused backward is ~4/3 of standard backprop per step (RevNet's
    # figure; an unfused inverse-then-VJP would be ~5/3).
    ref = compiled_grad(lambda p, x1, x2: loss_scan_ref(p, x1, x2, 8), p, x1, x2)
    ratio = f8 / flop_count(ref)
    assert 1.0 < ratio < 1.45, ratio


def test_while_backward_runs_exactly_the_steps_taken():
    """Structural check: the backward is a while loop of trip-count iterations."""
    p = make_params(0, 3, jnp.float32)
    x1, x2 = make_inputs(0, 2, 3, jnp.float32)
    loss = _while_loss(1024, 8)
    text = str(jax.make_jaxpr(jax.grad(loss))(p, x1, x2))
    assert "scan" not in text and "1024" in text  # the bound is only in the cond
    assert text.count("while[") == 2  # one forward, one backward loop
    with backward_steps() as seen:
        g = jax.jit(jax.grad(loss))(p, x1, x2)
        jax.block_until_ready(g)
    assert [int(m) for m in seen] == [8, 7, 6, 5, 4, 3, 2, 1]

    # Under vmap lanes run until the slowest is done; a finished lane is held
    # fixed (its counter stays at 0), so it is walked back its own steps only.
    stops = jnp.array([2, 5, 3])

    def loss_v(p, x1, stop):
        def body(c):
            return (*coupling_step(p, c[0], c[1]), c[2] + 1, c[3])

        y1, y2, _, _ = while_loop(
            lambda c: c[2] < c[3], body, (x1, x2[0], 0, stop), max_steps=1024
        )
        return readout(y1, y2)

    with backward_steps() as seen:
        gv = jax.jit(jax.vmap(jax.grad(loss_v, argnums=1), (None, 0, 0)))(
            p, x1[:1].repeat(3, 0), stops
        )
        jax.block_until_ready(gv)
    counts = np.asarray([np.asarray(m) for m in seen]).reshape(-1)
    # the callback sees every lane at every iteration: 5 iterations x 3 lanes.
    assert counts.size == 15
    assert sorted(counts[counts > 0].tolist()) == sorted(
        [k for s in (2, 5, 3) for k in range(1, s + 1)]
    )


# --------------------------------------------------------------------------- #
# Errors.


def test_invert_true_refuses_a_non_invertible_body_naming_the_equation():
    def body(c):
        x, i = c
        return x * x, i + 1  # x used twice: cannot be solved for x

    with pytest.raises(NotInvertibleError, match=r"`mul`.*test_while_loop\.py"):
        while_loop(lambda c: c[1] < 3, body, (jnp.ones(3), 0), mode="invert")
    with pytest.raises(NotInvertibleError, match="init"):
        scan(
            lambda c, x: (jnp.abs(c) + x, None),
            jnp.ones(3),
            jnp.ones((4, 3)),
            mode="invert",
        )
    # No gradient is ever produced for them: the error comes at trace time.
    with pytest.raises(NotInvertibleError):
        jax.grad(
            lambda x: jnp.sum(
                while_loop(lambda c: c[1] < 3, body, (x, 0), mode="invert")[0]
            )
        )(jnp.ones(3))


def test_a_decision_without_max_steps_is_refused_naming_its_equation():
    """Without max_steps a while loop has no room to store a decision per
    step: mode='invert' is refused in one line naming the deciding equation,
    its source line and what works instead."""

    def body(c):
        x, i = c
        return x + jnp.where(x > 0.5, 1.0, -0.5), i + 1  # `gt` decides

    with pytest.raises(ValueError) as e:
        while_loop(lambda c: c[1] < 3, body, (jnp.ones(3), 0), mode="invert")
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert msg.startswith("while_loop: a decision (`gt` at "), msg
    assert "test_while_loop.py:" in msg and "body_fun `body`" in msg, msg
    for remedy in ("max_steps", "mode='checkpoint'", "decisions='recompute'"):
        assert remedy in msg, msg
    assert "kinks" not in msg, msg


@pytest.mark.parametrize(
    "bad,exc",
    [
        (-1, ValueError),
        (2.5, TypeError),
        (3.0, TypeError),
        ("3", TypeError),
        (True, TypeError),
    ],
)
def test_bad_max_steps(bad, exc):
    with pytest.raises(exc, match="max_steps"):
        while_loop(lambda c: c < 3.0, lambda c: c + 1.0, 0.0, max_steps=bad)


def test_while_max_steps_accepts_numpy_integers():
    out = while_loop(lambda c: c < 100.0, lambda c: c + 1.0, 0.0, max_steps=np.int64(4))
    assert float(out) == 4.0


def test_type_errors():
    with pytest.raises(TypeError, match="boolean scalar"):
        while_loop(lambda c: c, lambda c: c + 1.0, jnp.ones(2))
    with pytest.raises(TypeError, match="same shapes and dtypes"):
        while_loop(lambda c: True, lambda c: (c + 1.0).astype(jnp.float16), jnp.ones(2))
    with pytest.raises(TypeError, match="same structure"):
        while_loop(lambda c: True, lambda c: (c, c), jnp.ones(2))
    with pytest.raises(ValueError, match="inconsistent lengths"):
        scan(lambda c, x: (c + x, None), jnp.ones(2), jnp.ones((3, 2)), length=4)
    with pytest.raises(ValueError, match="explicit length"):
        scan(lambda c, x: (c + 1.0, None), jnp.ones(2), None)
    # Forward mode is not available for a custom VJP; the loop says so (under
    # JAX_CUSTOM_VJP3, jax 0.10 raises its own error first).
    jax_first = UNDER_CUSTOM_VJP3 and jax.__version_info__ < (0, 11)
    with pytest.raises(
        NotImplementedError if jax_first else TypeError,
        match="" if jax_first else "reverse mode only",
    ):
        jax.jvp(
            lambda x: while_loop(lambda c: c < 3.0, lambda c: c + 1.0, x),
            (1.0,),
            (1.0,),
        )


# --------------------------------------------------------------------------- #
# Bad arguments: one-line errors naming the argument and the value.


def _scan_call(**kwargs):
    return scan(lambda c, x: (c + x, c), 0.0, jnp.arange(3.0), **kwargs)


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        ({"unroll": -1}, ValueError, ["unroll", "-1", "non-negative"]),
        ({"unroll": 1.5}, TypeError, ["unroll", "1.5", "bool"]),
        ({"unroll": "2"}, TypeError, ["unroll", "'2'"]),
        ({"unroll": None}, TypeError, ["unroll", "None"]),
        ({"length": 2.5}, TypeError, ["length", "2.5", "integer"]),
        ({"length": "3"}, TypeError, ["length", "'3'"]),
        ({"length": True}, TypeError, ["length", "True", "integer"]),
        ({"length": -1}, ValueError, ["length", "-1"]),
        ({"reverse": "yes"}, TypeError, ["reverse", "'yes'", "bool"]),
        ({"reverse": None}, TypeError, ["reverse", "None", "bool"]),
        ({"reverse": 1}, TypeError, ["reverse", "1", "bool"]),
    ],
    ids=lambda v: repr(v) if isinstance(v, dict) else "",
)
def test_scan_bad_arguments(kwargs, exc, words):
    with pytest.raises(exc) as info:
        _scan_call(**kwargs)
    message = str(info.value)
    assert "\n" not in message and message.startswith("scan: "), message
    for word in words:
        assert word in message, (word, message)


@pytest.mark.lax_reverse_scan_reference
def test_scan_accepts_numpy_arguments():
    got = _scan_call(length=np.int64(3), reverse=np.bool_(True), unroll=np.int32(2))
    want = lax.scan(lambda c, x: (c + x, c), 0.0, jnp.arange(3.0), reverse=True)
    rtol = tolerance(jnp.float32, "values")  # a sum of three numbers
    assert_trees_close(got, want, rtol, floor=0.0, exact_dtypes=True)


@pytest.mark.parametrize("arg", ["length", "reverse", "unroll"])
def test_scan_traced_static_arguments_are_reported(arg):
    value = {"length": 3, "reverse": True, "unroll": 2}[arg]
    with pytest.raises(TypeError, match=f"scan: {arg} must be .*known at trace time"):
        jax.jit(lambda v: _scan_call(**{arg: v}))(value)


def test_while_bad_arguments_are_one_line_and_named():
    cases = [
        (lambda: while_loop(3, lambda c: c, 0.0), "cond_fun"),
        (lambda: while_loop(lambda c: c < 1.0, "body", 0.0), "body_fun"),
        (
            lambda: while_loop(lambda c: c < 1.0, lambda c: c, 0.0, max_steps=np.True_),
            "True",
        ),
        (
            lambda: jax.jit(
                lambda n: while_loop(
                    lambda c: c < 3.0, lambda c: c + 1.0, 0.0, max_steps=n
                )
            )(3),
            "known at trace time",
        ),
    ]
    for call, word in cases:
        with pytest.raises(TypeError) as info:
            call()
        message = str(info.value)
        assert "\n" not in message and message.startswith("while_loop: "), message
        assert word in message, message
    with pytest.raises(TypeError, match="scan: f must be callable, got 3"):
        scan(3, 0.0, jnp.ones(3))


def test_a_new_callback_in_the_same_body_is_called_not_the_cached_one():
    """The compiled forward loop is reused only for the same callback function."""
    calls: dict[str, int] = {"a": 0, "b": 0}

    def body_calling(name):
        def tick():
            calls[name] += 1

        def body(c):
            x, i = c
            jax.debug.callback(tick)
            return x + 1.0, i + 1

        return body

    for name in ("a", "b"):
        while_loop(lambda c: c[1] < 3, body_calling(name), (jnp.ones(2), 0))
        scan(
            lambda c, x, n=name: (body_calling(n)(c), None),
            (jnp.ones(2), 0),
            None,
            length=2,
        )
    jax.effects_barrier()
    assert calls == {"a": 5, "b": 5}


# --------------------------------------------------------------------------- #
# Regressions: weak types, unperturbed leaves, zero-length scans.


def _types(tree):
    # lax.scan may give back an unchanged Python scalar leaf as it is.
    return jax.tree_util.tree_map(lambda a: _dtype_weak(jnp.asarray(a)), tree)


def _dtype_weak(a):
    return a.dtype, a.weak_type


def _weak_step(i, h, s, m, x, with_max):
    """A step whose carry holds a Python int ``i`` and a Python float ``s``
    (weak, and kept weak by the step) meeting float arrays."""
    h = h + jnp.tanh(x * s + i)
    return i + 1, h, s * 1.5, jnp.maximum(m, jnp.max(h)) if with_max else m


_WEAK_MODES = [
    ("invert", False, {}),
    ("store", True, {}),
    ("checkpoint", True, {"mode": "checkpoint"}),
]


@pytest.mark.xfail(
    UNDER_SCAN3,
    reason="open: under JAX_SCAN3 the loops' carry loses its weak type",
    strict=False,
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize(
    "mode,with_max,kw", _WEAK_MODES, ids=[m[0] for m in _WEAK_MODES]
)
@pytest.mark.slow
def test_scan_keeps_weak_types_of_python_scalar_carries(dtype, mode, with_max, kw):
    def body(c, x):
        c = _weak_step(*c, x, with_max)
        return c, c[1] * c[2]

    def run(scan_fn, **kw):
        def f(h, s):
            return scan_fn(
                body, (0, h, s, 0.0), jnp.linspace(0.1, 0.5, 4, dtype=dtype), **kw
            )

        return f

    def loss(f):
        def g(h, s):
            (_, h, s, m), ys = f(h, s)
            return jnp.sum(jnp.sin(h) * m) + jnp.sum(ys) + s

        return g

    with jax.enable_x64(dtype == jnp.float64), jax.numpy_dtype_promotion("strict"):
        h0 = jnp.linspace(-0.5, 0.5, 3, dtype=dtype)
        want = jax.tree_util.tree_map(jnp.asarray, run(lax.scan)(h0, 0.7))
        with modes_chosen() as seen:
            got = run(scan, **kw)(h0, 0.7)
        assert [m.kind for m in seen] == [mode]
        assert _types(got) == _types(want)
        assert_trees_close(got, want, tolerance(dtype), floor=0.0, exact_dtypes=True)
        g_want = jax.grad(loss(run(lax.scan)), (0, 1))(h0, 0.7)
        g_got = jax.grad(loss(run(scan, **kw)), (0, 1))(h0, 0.7)
        assert _types(g_got) == _types(g_want)
        assert_trees_close(
            g_got, g_want, tolerance(dtype), floor=0.0, exact_dtypes=True
        )


@pytest.mark.xfail(
    UNDER_SCAN3,
    reason="open: under JAX_SCAN3 the loops' carry loses its weak type",
    strict=False,
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize(
    "mode,with_max,kw", _WEAK_MODES, ids=[m[0] for m in _WEAK_MODES]
)
def test_while_loop_keeps_weak_types_of_python_scalar_carries(
    dtype, mode, with_max, kw
):
    def body(c):
        return _weak_step(*c, 0.25, with_max)

    def run(kw):
        def f(h, s):
            init = (0, h, s, 0.0)
            if kw is None:
                return lax.fori_loop(0, 3, lambda _, c: body(c), init)
            return while_loop(lambda c: c[0] < 3, body, init, max_steps=5, **kw)

        return f

    def loss(f):
        def g(h, s):
            _, h, s, m = f(h, s)
            return jnp.sum(jnp.sin(h) * m) + s

        return g

    with jax.enable_x64(dtype == jnp.float64), jax.numpy_dtype_promotion("strict"):
        h0 = jnp.linspace(-0.5, 0.5, 3, dtype=dtype)
        want = jax.tree_util.tree_map(jnp.asarray, run(None)(h0, 0.7))
        with modes_chosen() as seen:
            got = run(kw)(h0, 0.7)
        assert [m.kind for m in seen] == [mode]
        assert _types(got) == _types(want)
        assert_trees_close(got, want, tolerance(dtype), floor=0.0, exact_dtypes=True)
        g_want = jax.grad(loss(run(None)), (0, 1))(h0, 0.7)
        g_got = jax.grad(loss(run(kw)), (0, 1))(h0, 0.7)
        assert _types(g_got) == _types(g_want)
        assert_trees_close(
            g_got, g_want, tolerance(dtype), floor=0.0, exact_dtypes=True
        )


def _zero_step(c, x, w):
    a, m = c
    a = a + jnp.sin(m * w) * x
    return (a, m), a * w


def _zero_step_max(c, x, w):
    a, m = c
    a = a + jnp.sin(m * w) * x
    return (a, jnp.maximum(m, jnp.max(a))), a * w


_ZERO_MODES = [
    ("invert", _zero_step, {}),
    ("store", _zero_step_max, {}),
    ("checkpoint", _zero_step_max, {"mode": "checkpoint"}),
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("with_xs", [True, False], ids=["xs", "length"])
@pytest.mark.parametrize("mode,step,kw", _ZERO_MODES, ids=[m[0] for m in _ZERO_MODES])
def test_zero_length_scan_behaves_as_lax_scan(dtype, with_xs, mode, step, kw):
    def run(scan_fn, **kw):
        def f(a, m, xs, w):
            body = functools.partial(step, w=w)
            if with_xs:
                return scan_fn(body, (a, m), xs, **kw)
            return scan_fn(lambda c, _: body(c, 0.5), (a, m), None, length=0, **kw)

        return f

    def loss(f):
        def g(*args):
            (a, m), ys = f(*args)
            return jnp.sum(jnp.sin(a)) + jnp.sum(m**2) + jnp.sum(ys)

        return g

    with jax.enable_x64(dtype == jnp.float64):
        args = (
            jnp.linspace(-0.5, 0.5, 3, dtype=dtype),
            jnp.asarray(0.7, dtype),
            jnp.zeros((0, 3), dtype),
            jnp.asarray(1.3, dtype),
        )
        want = run(lax.scan)(*args)
        with modes_chosen() as seen:
            got = run(scan, **kw)(*args)
        assert [m.kind for m in seen] == [mode]
        assert _types(got) == _types(want)
        assert_trees_close(got, want, tolerance(dtype), floor=0.0, exact_dtypes=True)
        g_want = jax.grad(loss(run(lax.scan)), (0, 1, 2, 3))(*args)
        g_got = jax.grad(loss(run(scan, **kw)), (0, 1, 2, 3))(*args)
        assert _types(g_got) == _types(g_want)
        assert_trees_close(
            g_got, g_want, tolerance(dtype), floor=0.0, exact_dtypes=True
        )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("mode,step,kw", _ZERO_MODES, ids=[m[0] for m in _ZERO_MODES])
def test_while_loop_bounded_by_zero_steps(dtype, mode, step, kw):
    def run(**kw):
        def f(a, m, w):
            def body(c):
                (a, m), _ = step(c[:2], 0.5, w)
                return a, m, c[2] + 1

            return while_loop(lambda c: c[2] < 3, body, (a, m, 0), max_steps=0, **kw)

        return f

    with jax.enable_x64(dtype == jnp.float64):
        args = (
            jnp.linspace(-0.5, 0.5, 3, dtype=dtype),
            jnp.asarray(0.7, dtype),
            jnp.asarray(1.3, dtype),
        )
        with modes_chosen() as seen:
            got = run(**kw)(*args)
        assert [m.kind for m in seen] == [mode]
        assert_trees_close(
            got,
            (args[0], args[1], jnp.asarray(0)),
            tolerance(dtype),
            floor=0.0,
            exact_dtypes=True,
        )

        def loss(a, m, w):
            a, m, _ = run(**kw)(a, m, w)
            return jnp.sum(jnp.sin(a)) + m**2

        g = jax.grad(loss, (0, 1, 2))(*args)
        assert_trees_close(
            g,
            (jnp.cos(args[0]), 2 * args[1], jnp.zeros((), dtype)),
            tolerance(dtype),
            floor=0.0,
            exact_dtypes=True,
        )


def _guarded_step(c, x):
    h, k, g, m = c
    # k is not differentiated (not in argnums), g only under stop_gradient.
    h = h + jnp.tanh(x * nondifferentiable(k) + nondifferentiable(lax.stop_gradient(g)))
    m = jnp.maximum(m, jnp.max(h)) if m is not None else None
    return (h, k * 1.5, g + h, m), h


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize(
    "mode,with_max,kw", _WEAK_MODES, ids=[m[0] for m in _WEAK_MODES]
)
def test_loops_do_not_differentiate_unperturbed_carry_leaves(dtype, mode, with_max, kw):
    def scan_loss(scan_fn, **kw):
        def f(h, g, k):
            m = jnp.zeros((), dtype) if with_max else None
            (h, _, g, m), ys = scan_fn(_guarded_step, (h, k, g, m), xs, **kw)
            return (
                jnp.sum(jnp.sin(h)) + jnp.sum(g) + jnp.sum(ys) + (m if with_max else 0)
            )

        return f

    def while_loss(kw):
        def f(h, g, k):
            m = jnp.zeros((), dtype) if with_max else None

            def body(c):
                (h, k, g, m), _ = _guarded_step(c[:4], 0.25)
                return h, k, g, m, c[4] + 1

            init = (h, k, g, m, 0)
            if kw is None:
                out = lax.fori_loop(0, 3, lambda _, c: body(c), init)
            else:
                out = while_loop(lambda c: c[4] < 3, body, init, max_steps=5, **kw)
            h, _, g, m, _ = out
            return jnp.sum(jnp.sin(h)) + jnp.sum(g) + (m if with_max else 0)

        return f

    with jax.enable_x64(dtype == jnp.float64):
        xs = jnp.linspace(0.1, 0.5, 4, dtype=dtype)
        args = (jnp.linspace(-0.5, 0.5, 3, dtype=dtype), jnp.full(3, 0.2, dtype))
        args = (*args, jnp.asarray(0.7, dtype))
        for got_loss, want_loss in [
            (scan_loss(scan, **kw), scan_loss(lax.scan)),
            (while_loss(kw), while_loss(None)),
        ]:
            want = jax.grad(want_loss, (0, 1))(*args)
            with modes_chosen() as seen:
                got = jax.grad(got_loss, (0, 1))(*args)
            assert [m.kind for m in seen] == [mode]
            assert_trees_close(
                got, want, tolerance(dtype), floor=0.0, exact_dtypes=True
            )
