"""Convolutions inside reversed scans run in the layout XLA:CPU runs fast.

The engine evaluates every ``conv_general_dilated`` through
``revnet/_engine/fast_convolutions.py``: explicit transposes around a canonical
(``b01f_01io->b01f``) convolution, for the forward value and for every
convolution of its VJP. These tests check that values and derivatives are the
primitive's for every layout and convolution option, that a reversible conv
stack's gradients equal plain autodiff's, and the structural cause of the
speed-up: the compiled training step holds no non-canonical convolution.
"""

from __future__ import annotations

import re

import haiku as hk
import jax
import jax.numpy as jnp
import pytest
from jax import lax

import revnet
from revnet import blocks
from revnet._engine import fast_convolutions
from tests.helpers import assert_trees_close, cotangents_like, tolerance

DTYPES = ["float32", "float64"]

# (input shape, kernel shape, conv keyword arguments): layouts, strides,
# padding, dilations and group counts.
CASES = {
    "nhwc": (
        (2, 9, 8, 4),
        (3, 3, 4, 6),
        dict(dimension_numbers=("NHWC", "HWIO", "NHWC")),
    ),
    "nchw": (
        (2, 4, 9, 8),
        (6, 4, 3, 3),
        dict(dimension_numbers=("NCHW", "OIHW", "NCHW")),
    ),
    "mixed": (
        (2, 4, 9, 8),
        (3, 6, 4, 3),
        dict(dimension_numbers=("NCHW", "HOIW", "NHWC")),
    ),
    "strided": (
        (2, 9, 8, 4),
        (3, 3, 4, 6),
        dict(
            window_strides=(2, 3),
            padding=((1, 2), (0, 1)),
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        ),
    ),
    "dilated": (
        (2, 9, 8, 4),
        (3, 2, 4, 6),
        dict(
            lhs_dilation=(2, 1),
            rhs_dilation=(1, 2),
            padding=((1, 1), (2, 0)),
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        ),
    ),
    "grouped": (
        (2, 9, 8, 4),
        (3, 3, 2, 6),
        dict(feature_group_count=2, dimension_numbers=("NHWC", "HWIO", "NHWC")),
    ),
    "batch_grouped": (
        (4, 9, 8, 4),
        (3, 3, 4, 6),
        dict(batch_group_count=2, dimension_numbers=("NHWC", "HWIO", "NHWC")),
    ),
    "1d": ((2, 11, 3), (3, 3, 5), dict(dimension_numbers=("NWC", "WIO", "NWC"))),
    "3d": (
        (1, 3, 5, 4, 2),
        (2, 4, 3, 2, 3),
        dict(dimension_numbers=("NCDHW", "DOHWI", "NDHWC")),
    ),
}


def _conv_pair(case, dtype, seed):
    """Operands of ``CASES[case]`` and the two convolutions to compare.

    Returns ``(lhs, rhs, plain, ours)``: ``plain`` is ``lax.conv_general_dilated``
    and ``ours`` the engine's evaluator given the equation's bind params.
    """
    lhs_shape, rhs_shape, kw = CASES[case]
    k1, k2 = jax.random.split(jax.random.key(seed))
    lhs = jax.random.normal(k1, lhs_shape, dtype)
    rhs = jax.random.normal(k2, rhs_shape, dtype)
    kw = {"window_strides": (1,) * (lhs.ndim - 2), "padding": "SAME", **kw}

    def plain(a, b):
        return lax.conv_general_dilated(a, b, **kw)

    (eqn,) = [
        e
        for e in jax.make_jaxpr(plain)(lhs, rhs).jaxpr.eqns
        if e.primitive.name == "conv_general_dilated"
    ]

    def ours(a, b):
        return fast_convolutions.conv(dict(eqn.params), [a, b])[0]

    return lhs, rhs, plain, ours


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.slow
def test_canonical_conv_matches_the_primitive(case, dtype):
    with jax.enable_x64(dtype == "float64"):
        lhs, rhs, plain, ours = _conv_pair(case, dtype, seed=0)
        out, vjp = jax.vjp(plain, lhs, rhs)
        rout, rvjp = jax.vjp(ours, lhs, rhs)
        rtol = tolerance(dtype)
        assert_trees_close(rout, out, rtol, "output")
        cts = cotangents_like(out)
        assert_trees_close(rvjp(cts), vjp(cts), rtol, "cotangent")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["nchw", "strided", "grouped"])
def test_canonical_conv_second_order(case, dtype):
    # The canonical VJP is itself differentiable, with the primitive's result.
    with jax.enable_x64(dtype == "float64"):
        lhs, rhs, plain, ours = _conv_pair(case, dtype, seed=1)

        def grad_norm(conv):
            def inner(a, b):
                return jnp.sum(jnp.sin(conv(a, b)))

            return lambda a, b: jnp.sum(jax.grad(inner, argnums=(0, 1))(a, b)[1] ** 2)

        got = jax.grad(grad_norm(ours), argnums=(0, 1))(lhs, rhs)
        want = jax.grad(grad_norm(plain), argnums=(0, 1))(lhs, rhs)
        assert_trees_close(got, want, tolerance(dtype), "second order")


def _dim_labels(compiled_text: str) -> list[str]:
    return re.findall(r"convolution\(.*?dim_labels=([^,\s]+)", compiled_text)


def _conv_stack(depth, reversible):
    def residual(h):
        h = hk.Conv2D(4, 3)(h)
        h = hk.BatchNorm(True, True, 0.9)(h, True)
        return hk.Conv2D(4, 3)(jax.nn.relu(h))

    def block(h):
        return blocks.AdditiveCoupling(residual, residual)(h)

    return hk.transform_with_state(
        lambda x: blocks.ReversibleSequence(block, depth, reversible=reversible)(x)
    )


def _loss(net):
    def loss(params, x, state):
        y, _ = net.apply(params, state, None, x)
        return jnp.sum(jnp.sin(y))

    return loss


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's layouts")
def test_reversible_conv_step_has_only_canonical_convolutions():
    x = jax.ShapeDtypeStruct((2, 8, 8, 8), jnp.float32)
    labels = {}
    for reversible in (True, False):
        net = _conv_stack(4, reversible)
        params, state = jax.eval_shape(net.init, jax.random.PRNGKey(0), x)
        step = jax.jit(jax.grad(_loss(net), argnums=(0, 1)))
        text = step.lower(params, x, state).compile().as_text()
        assert re.search(r"\bwhile\(", text), "the stack should run in a loop"
        labels[reversible] = set(_dim_labels(text))
    # The plain-autodiff twin shows what the check detects: JAX's own conv
    # VJPs are not canonical, and XLA:CPU leaves them so inside the loop.
    assert labels[False] - {"b01f_01io->b01f"}, labels
    assert labels[True] == {"b01f_01io->b01f"}, labels


@pytest.mark.parametrize("dtype", DTYPES)
def test_reversible_conv_stack_gradients_equal_plain_autodiff(dtype):
    with jax.enable_x64(dtype == "float64"):
        x = jax.random.normal(jax.random.key(1), (2, 8, 8, 8), dtype)
        rev, twin = _conv_stack(3, True), _conv_stack(3, False)
        params, state = jax.jit(twin.init)(jax.random.PRNGKey(0), x)
        params = jax.tree.map(lambda p: p.astype(dtype), params)
        g = jax.grad(_loss(rev), argnums=(0, 1))(params, x, state)
        ref = jax.grad(_loss(twin), argnums=(0, 1))(params, x, state)
        assert_trees_close(g, ref, tolerance(dtype), "gradient")


@pytest.mark.parametrize("dtype", DTYPES)
def test_nchw_conv_in_invertible_function(dtype):
    # A coupling written with lax convolutions in NCHW/OIHW: transposed inside.
    with jax.enable_x64(dtype == "float64"):
        k1, k2 = jax.random.split(jax.random.key(2))
        w = 0.2 * jax.random.normal(k1, (3, 3, 3, 3), dtype)
        x = jax.random.normal(k2, (2, 6, 5, 5), dtype)
        dn = ("NCHW", "OIHW", "NCHW")

        def f(x, w):
            def body(h, _):
                a, b = jnp.split(h, 2, axis=1)
                a = a + jnp.tanh(
                    lax.conv_general_dilated(b, w, (1, 1), "SAME", dimension_numbers=dn)
                )
                b = b + jnp.tanh(
                    lax.conv_general_dilated(a, w, (1, 1), "SAME", dimension_numbers=dn)
                )
                return jnp.concatenate([a, b], axis=1), None

            return lax.scan(body, x, None, length=4)[0]

        def rev(x, w):
            return revnet.invertible(lambda x: f(x, w))(x)

        cts = cotangents_like(jax.eval_shape(f, x, w), seed=3)
        _, vjp = jax.vjp(f, x, w)
        _, rvjp = jax.vjp(rev, x, w)
        assert_trees_close(rvjp(cts), vjp(cts), tolerance(dtype), "cotangent")
