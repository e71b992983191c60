"""Tests for ``revnet.scan``: gradients, the carries ``lax.scan`` accepts, unroll.

Every gradient is compared with ``jax.grad`` of the same loop written with
``lax.scan`` over the known number of steps, elementwise, for every input and
every closed-over parameter. Memory and compute claims are checked on compiled
programs (``memory_analysis``, ``cost_analysis``), never on wall time.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

from revnet.loops import scan, while_loop
from tests.helpers import (
    assert_trees_close,
    temp_size,
    tolerance,
)
from tests.loops.programs import (
    compiled_grad,
    coupling_step,
    make_inputs,
    make_params,
    memory_setup,
    readout,
)

# Every example compiles a new program (~1 s on 2 cores): a third of the
# profile's examples, but at least 8, keeps the file near a minute.
_FEW = settings(max_examples=max(8, settings.default.max_examples // 3))


# --------------------------------------------------------------------------- #
# scan.


def _scan_f(p):
    def f(c, x):
        x1, x2 = c
        x1 = x1 + p["dt"] * jnp.tanh(x2 @ p["w1"] + x["b"])
        x2 = x2 + x["h"] * jnp.tanh(x1 @ p["w2"])
        return (x1, x2), {"m": jnp.mean(x2, axis=-1), "s": jnp.sum(x1 * x2)}

    return f


def _scan_loss(scan_fn, reverse):
    def loss(p, x1, x2, xs):
        (y1, y2), ys = scan_fn(_scan_f(p), (x1, x2), xs, reverse=reverse)
        w = jnp.arange(1, ys["s"].shape[0] + 1, dtype=ys["s"].dtype)
        return readout(y1, y2) + jnp.sum(ys["m"] ** 2) + jnp.sum(w * ys["s"])

    return loss


def _scan_value_and_grad(scan_fn):
    def vg(p, x1, x2, xs, reverse):
        out = scan_fn(_scan_f(p), (x1, x2), xs, reverse=reverse)
        grads = jax.grad(_scan_loss(scan_fn, reverse), (0, 1, 2, 3))(p, x1, x2, xs)
        return out, grads

    return jax.jit(vg, static_argnums=4)


_scan_vg, _lax_scan_vg = _scan_value_and_grad(scan), _scan_value_and_grad(lax.scan)


@_FEW
@given(
    d=st.integers(1, 3),
    length=st.sampled_from([1, 2, 5, 9]),
    reverse=st.booleans(),
    f64=st.booleans(),
    seed=st.integers(0, 2**16),
)
@pytest.mark.slow
def test_scan_matches_lax_scan(d, length, reverse, f64, seed):
    dtype = jnp.float64 if f64 else jnp.float32
    with jax.enable_x64(f64):
        p = make_params(seed, d, dtype)
        x1, x2 = make_inputs(seed, 2, d, dtype)
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed + 7))
        xs = {
            "b": (0.2 * jax.random.normal(k1, (length, d))).astype(dtype),
            "h": (0.3 + 0.1 * jax.random.normal(k2, (length,))).astype(dtype),
        }
        got = _scan_vg(p, x1, x2, xs, reverse)
        want = _lax_scan_vg(p, x1, x2, xs, reverse)
        assert_trees_close(got, want, tolerance(dtype), floor=0.0, exact_dtypes=True)


def test_scan_length_without_xs_integer_carry_and_vmap():
    p = make_params(5, 3, jnp.float32)
    x1, x2 = make_inputs(5, 4, 3, jnp.float32)

    def f(c, _):
        y1, y2 = coupling_step(p, c[0], c[1])
        return (y1, y2, c[2] + 2), c[2]

    def loss(scan_fn, x1, x2):
        (y1, y2, i), ys = scan_fn(f, (x1, x2, 1), None, length=6)
        return readout(y1, y2), (i, ys)

    (_, (i, ys)), g = jax.value_and_grad(
        lambda *a: loss(scan, *a), (0, 1), has_aux=True
    )(x1, x2)
    assert int(i) == 13
    np.testing.assert_array_equal(ys, np.arange(1, 13, 2))
    want = jax.grad(lambda *a: loss(lax.scan, *a)[0], (0, 1))(x1, x2)
    rtol = tolerance(jnp.float32)
    assert_trees_close(g, want, rtol, floor=0.0, exact_dtypes=True)
    gv = jax.vmap(jax.grad(lambda *a: loss(scan, *a)[0], (0, 1)))(x1, x2)
    assert_trees_close(
        gv,
        jax.vmap(jax.grad(lambda *a: loss(lax.scan, *a)[0], (0, 1)))(x1, x2),
        rtol,
        floor=0.0,
        exact_dtypes=True,
    )


def test_scan_memory_is_flat_in_length():
    p, x1, x2 = memory_setup()

    def temp(scan_fn, n):
        def loss(p, x1, x2):
            (y1, y2), _ = scan_fn(
                lambda c, _: (coupling_step(p, *c), None), (x1, x2), None, length=n
            )
            return readout(y1, y2)

        return temp_size(compiled_grad(loss, p, x1, x2))

    ours = {n: temp(scan, n) for n in (8, 1024)}
    ref = {n: temp(lax.scan, n) for n in (8, 1024)}
    assert ours[1024] <= 1.1 * ours[8], ours
    assert ref[1024] >= 50 * ref[8], ref


# --------------------------------------------------------------------------- #
# scan accepts the carries lax.scan accepts: lists, lists inside tuples, a pair
# returned as a list, Python scalars in the carry.

# (dtype, x64): float32 with and without x64 (under x64 a Python float in the
# carry is a weak float64 that lax.scan narrows to float32), and float64.
_DTYPES = [
    pytest.param(jnp.float32, False, id="f32"),
    pytest.param(jnp.float32, True, id="f32-x64"),
    pytest.param(jnp.float64, True, id="f64"),
]


def _list_step(p, c, x):
    """``(x1, x2) -> (x1, x2)``, an additive coupling driven by ``x = [b, h]``."""
    x1, x2 = c
    x1 = x1 + p["dt"] * jnp.tanh(x2 @ p["w1"] + x[0])
    x2 = x2 + x[1] * jnp.tanh(x1 @ p["w2"])
    return x1, x2


def _list_pair(p):
    """A list carry, and the pair ``(carry, y)`` returned as a list."""

    def f(c, x):
        x1, x2 = _list_step(p, c, x)
        return [[x1, x2], jnp.sum(x1 * x2)]

    return f, lambda x1, x2: [x1, x2]


def _list_in_tuple(p):
    """A list inside a tuple, a Python float ``t`` and a list of ys."""

    def f(c, x):
        (x1, x2), t = c
        x1, x2 = _list_step(p, (x1, x2), x)
        return ([x1, x2], t + p["dt"]), [jnp.mean(x2, axis=-1), t * jnp.sum(x1)]

    return f, lambda x1, x2: ([x1, x2], 0.5)


def _python_int_leaf(p):
    """A Python ``0`` that the body turns into a float: lax.scan promotes it."""

    def f(c, x):
        x1, x2, t = c
        x1, x2 = _list_step(p, (x1, x2), x)
        return [x1, x2, t + p["dt"]], t * jnp.sum(x2)

    return f, lambda x1, x2: [x1, x2, 0]


def _python_float_list(p):
    """A list of an array and a Python float (weak, and float64 under x64)."""

    def f(c, x):
        x1, s = c
        x1 = x1 + p["dt"] * jnp.tanh(x[0] + s * p["b"])
        s = s + jnp.sum(x1)
        return [x1, s], x1

    return f, lambda x1, x2: [x1, 1.0]


_LIST_CASES = {
    "list_pair": _list_pair,
    "list_in_tuple": _list_in_tuple,
    "python_int_leaf": _python_int_leaf,
    "python_float_list": _python_float_list,
}


def _tree_loss(out):
    leaves = jax.tree_util.tree_leaves(out)
    return sum(jnp.sum(jnp.sin(leaf)) * (n + 1) for n, leaf in enumerate(leaves))


def _list_value_and_grad(scan_fn, case):
    def loss(p, x1, x2, xs, reverse):
        f, make_init = _LIST_CASES[case](p)
        return _tree_loss(scan_fn(f, make_init(x1, x2), xs, reverse=reverse))

    def vg(p, x1, x2, xs, reverse):
        f, make_init = _LIST_CASES[case](p)
        out = scan_fn(f, make_init(x1, x2), xs, reverse=reverse)
        return out, jax.grad(loss, (0, 1, 2, 3))(p, x1, x2, xs, reverse)

    return vg


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("case", sorted(_LIST_CASES))
@pytest.mark.parametrize("dtype, x64", _DTYPES)
@pytest.mark.slow
def test_scan_list_carries_match_lax_scan(case, dtype, x64, reverse):
    with jax.enable_x64(x64):
        p = make_params(11, 3, dtype)
        x1, x2 = make_inputs(11, 2, 3, dtype)
        k1, k2 = jax.random.split(jax.random.PRNGKey(3))
        xs = [
            (0.2 * jax.random.normal(k1, (4, 3))).astype(dtype),
            (0.3 + 0.1 * jax.random.normal(k2, (4,))).astype(dtype),
        ]
        args = (p, x1, x2, xs, reverse)
        want = _list_value_and_grad(lax.scan, case)(*args)
        got = _list_value_and_grad(scan, case)(*args)
        # Same containers (lists stay lists), dtypes and values, elementwise.
        assert_trees_close(got, want, tolerance(dtype), floor=0.0, exact_dtypes=True)
        jitted = jax.jit(_list_value_and_grad(scan, case), static_argnums=4)
        assert_trees_close(
            jitted(*args), want, tolerance(dtype), floor=0.0, exact_dtypes=True
        )


def test_scan_pair_must_have_two_children_as_in_lax_scan():
    with pytest.raises(TypeError, match=r"must return a pair \(carry, y\)") as info:
        scan(lambda c, x: [c + x, c, c], 0.0, jnp.ones(3))
    assert "\n" not in str(info.value)
    with pytest.raises(TypeError, match="same structure"):
        scan(lambda c, x: ((c[0] + x, c[1]), x), [0.0, 1.0], jnp.ones(3))
    with pytest.raises(TypeError, match="same pytree structure"):
        lax.scan(lambda c, x: ((c[0] + x, c[1]), x), [0.0, 1.0], jnp.ones(3))


@pytest.mark.parametrize("x64", [False, True])
def test_while_python_scalars_in_carry_are_promoted_as_in_lax(x64):
    with jax.enable_x64(x64):
        w = jnp.asarray(0.5, jnp.float32)

        def body(c):
            return [c[0] + w * jnp.sin(c[1]), c[1] + w, c[2] + 1]

        def cond(c):
            return c[2] < 4

        got = while_loop(cond, body, [0, 1.0, 0])
        want = lax.while_loop(cond, body, [0, 1.0, 0])
        rtol = tolerance(jnp.float32, "values")
        assert_trees_close(got, want, rtol, floor=0.0, exact_dtypes=True)

        def loss(loop, w):
            def body_w(c):
                return [c[0] + w * jnp.sin(c[1]), c[1] + w, c[2] + 1]

            out = loop(body_w)
            return out[0] + out[1] ** 2

        g = jax.grad(lambda w: loss(lambda b: while_loop(cond, b, [0, 1.0, 0]), w))(w)
        ref = jax.grad(
            lambda w: loss(
                lambda b: lax.scan(lambda c, _: (b(c), None), [0, 1.0, 0], length=4)[0],
                w,
            )
        )(w)
        rtol = 1e-6  # a scalar through 4 steps: tighter than the table
        assert_trees_close(g, ref, rtol, floor=0.0, exact_dtypes=True)


# --------------------------------------------------------------------------- #
# scan's unroll.


@pytest.mark.parametrize("unroll", [1, 2, 3, 0, True, False, np.int64(2)])
@pytest.mark.parametrize("dtype, x64", _DTYPES[::2])
@pytest.mark.slow
def test_scan_unroll_matches_lax_scan(unroll, dtype, x64):
    with jax.enable_x64(x64):
        p = make_params(4, 3, dtype)
        x1, x2 = make_inputs(4, 2, 3, dtype)
        xs = {
            "b": 0.1 * jnp.ones((5, 3), dtype),
            "h": jnp.linspace(0.2, 0.4, 5, dtype=dtype),
        }

        def vg(scan_fn):
            def run(p, x1, x2, xs):
                return scan_fn(_scan_f(p), (x1, x2), xs, unroll=unroll)

            def loss(p, x1, x2, xs):
                (y1, y2), ys = run(p, x1, x2, xs)
                return readout(y1, y2) + jnp.sum(ys["m"] ** 2) + jnp.sum(ys["s"])

            args = (p, x1, x2, xs)
            out = (run(*args), jax.grad(loss, (0, 1, 2, 3))(*args))
            # The unroll of every scan in the gradient program: forward and backward.
            text = str(jax.make_jaxpr(jax.grad(loss, (0, 1, 2, 3)))(*args))
            return out, re.findall(r"\bunroll=(\w+)", text)

        got, got_unrolls = vg(scan)
        want, want_unrolls = vg(lax.scan)
        assert_trees_close(got, want, tolerance(dtype), floor=0.0, exact_dtypes=True)
        assert got_unrolls == want_unrolls and len(got_unrolls) == 2, (
            got_unrolls,
            want_unrolls,
        )
