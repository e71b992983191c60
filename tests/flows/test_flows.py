"""``revnet.flows``: the framework-free flow blocks.

Every block's derived log-determinant is checked against ``slogdet`` of its
Jacobian per example in float64; the LU convolution's is O(C) (no
factorisation in its program); a reversible stack of them differentiates as
its plain twin does.
"""

from __future__ import annotations

import doctest
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import revnet
from revnet import flows
from tests.helpers import (
    assert_trees_close,
    per_example_slogdet,
    primitives,
    tolerance,
)

RTOL = tolerance("float64", "log_det")  # against slogdet(jacfwd)
ATOL = tolerance("float64", "log_det_floor")  # for log-dets of zero


def _x(shape, seed=0, dtype=jnp.float64):
    return 1.0 + 2.0 * jax.random.normal(jax.random.key(seed), shape, dtype)


def _lu(c, seed=1, dtype=jnp.float64):
    lower, upper, diag = flows.lu_conv_init(jax.random.key(seed), c, dtype)
    # Away from the rotation: a diagonal that is not +-1 and triangles that
    # are not those of an orthogonal matrix.
    k = jax.random.split(jax.random.key(seed + 1), 3)
    return (
        lower + 0.3 * jax.random.normal(k[0], lower.shape, dtype),
        upper + 0.3 * jax.random.normal(k[1], upper.shape, dtype),
        diag * jnp.exp(0.5 * jax.random.normal(k[2], diag.shape, dtype)),
    )


def _cases():
    """``name -> (f, known, x)`` with ``f(*known, x)`` a flow step on a batch."""
    c = 6
    an = (0.3 * jnp.arange(c) - 0.5, 0.1 * jnp.arange(c) - 0.2)
    return {
        "actnorm": (flows.actnorm, an, _x((3, 2, 2, c))),
        "lu_conv": (flows.lu_conv, _lu(c), _x((3, 2, 2, c))),
        "squeeze": (flows.squeeze, (), _x((3, 4, 4, 2))),
        "unsqueeze": (flows.unsqueeze, (), _x((3, 2, 2, 8))),
        "split": (lambda x: flows.split(x), (), _x((3, 2, 2, c))),
        "glow step": (_glow_step, (an, _lu(c)), _x((3, 2, 2, c))),
    }


def _glow_step(an, lu, x):
    h = flows.lu_conv(*lu, flows.actnorm(*an, x))
    kept, other = flows.split(h)
    s = jnp.tanh(kept)
    return flows.merge(kept, other * jnp.exp(s) + s)


CASES = ["actnorm", "lu_conv", "squeeze", "unsqueeze", "split", "glow step"]


@pytest.mark.parametrize("name", CASES)
def test_log_det_equals_slogdet_of_the_jacobian(name):
    with jax.enable_x64(True):
        f, known, x = _cases()[name]
        n = tuple(range(len(known)))
        _, log_det = revnet.forward_and_log_det(
            f, *known, x, known_argnums=n, batch_ndim=1
        )
        ref = per_example_slogdet(lambda *a: (f(*a),), known, x, jac=jax.jacrev)
        np.testing.assert_allclose(log_det, ref, rtol=RTOL, atol=ATOL)


def test_split_and_merge_are_inverse_and_volume_preserving():
    with jax.enable_x64(True):
        x = _x((3, 2, 2, 6))
        y, log_det = revnet.forward_and_log_det(
            lambda a, b: flows.merge(a, b), *flows.split(x), batch_ndim=1
        )
        np.testing.assert_array_equal(y, x)
        np.testing.assert_array_equal(log_det, 0.0)


def test_the_lu_convolution_log_det_is_o_of_c():
    """The derived log-det of ``lu_conv`` reads the diagonal: no LU
    factorisation or determinant in its program, where the same matrix
    applied as a plain product gets a ``slogdet`` (O(C^3))."""
    lu, x = _lu(8, dtype=jnp.float32), _x((2, 8), dtype=jnp.float32)

    def with_log_det(f):
        def run(lu, x):
            return revnet.forward_and_log_det(
                f, *lu, x, known_argnums=(0, 1, 2), batch_ndim=1
            )

        return primitives(run, lu, x)

    dense = with_log_det(lambda lo, up, d, x: x @ flows.lu_matrix(lo, up, d))
    assert "lu" in dense, dense  # the check can fail
    assert "lu" not in with_log_det(flows.lu_conv)


def test_the_lu_convolution_inverts_with_triangular_solves():
    with jax.enable_x64(True):
        lu, x = _lu(6), _x((3, 2, 2, 6))
        y = flows.lu_conv(*lu, x)
        want = x @ flows.lu_matrix(*lu)
        np.testing.assert_allclose(y, want, rtol=tolerance("float64", "values"))
        (rebuilt,) = revnet.inverse(lambda h: flows.lu_conv(*lu, h), x)(y)
        np.testing.assert_allclose(
            rebuilt,
            x,
            rtol=tolerance("float64", "round_trip"),
            atol=1e-12,  # tighter than the table's: the test is relative
        )


def test_the_lu_convolution_starts_as_a_rotation():
    with jax.enable_x64(True):
        w = flows.lu_matrix(*flows.lu_conv_init(jax.random.key(3), 7, jnp.float64))
        np.testing.assert_allclose(
            w @ w.T, jnp.eye(7), atol=tolerance("float64", "values")
        )
        assert not np.allclose(jnp.abs(w), jnp.eye(7))


def _stack(ws, x, conv):
    for an, lu in ws:
        h = conv(lu, flows.actnorm(*an, x))
        kept, other = flows.split(h)
        s = jnp.tanh(kept @ jnp.ones((kept.shape[-1], other.shape[-1])) / 4)
        x = flows.merge(kept, other * jnp.exp(s) + s)
    return x


@pytest.mark.parametrize(
    "dtype", [pytest.param(jnp.float32, id="f32"), pytest.param(jnp.float64, id="f64")]
)
def test_reversible_gradients_equal_the_plain_ones(dtype):
    with jax.enable_x64(dtype == jnp.float64):
        c = 6
        # A flow as training starts it: rotations, small scales.
        ws = [
            (
                (0.1 * jnp.ones(c, dtype), 0.05 * jnp.arange(c, dtype=dtype)),
                flows.lu_conv_init(jax.random.key(i), c, dtype),
            )
            for i in range(4)
        ]
        x = jax.random.normal(jax.random.key(0), (3, c), dtype)
        base = flows.StandardNormal((c,))

        def loss(forward):
            def run(ws, x):
                z, log_det = forward(ws, x)
                return -jnp.mean(base.log_prob(z) + log_det)

            return run

        def stack(ws, x):
            return _stack(ws, x, lambda lu, h: flows.lu_conv(*lu, h))

        rev = revnet.invertible(stack, known_argnums=0)

        def reversible(ws, x):
            return revnet.forward_and_log_det(rev, ws, x, batch_ndim=1)

        def plain(ws, x):
            return revnet.forward_and_log_det(
                stack, ws, x, known_argnums=0, batch_ndim=1
            )

        got = jax.jit(jax.grad(loss(reversible), (0, 1)))(ws, x)
        want = jax.jit(jax.grad(loss(plain), (0, 1)))(ws, x)
        assert_trees_close(got, want, tolerance(dtype), "reversible vs plain")


def test_standard_normal():
    base = flows.StandardNormal((2, 3))
    z = base.sample(jax.random.key(0), (4,))
    assert z.shape == (4, 2, 3) and z.dtype == jnp.float32
    want = jnp.sum(jax.scipy.stats.norm.logpdf(z), axis=(1, 2))
    rtol = tolerance(jnp.float32, "values")  # closed forms
    np.testing.assert_allclose(base.log_prob(z), want, rtol=rtol)
    np.testing.assert_allclose(
        base.log_prob(jnp.zeros((2, 3))), -3 * math.log(2 * math.pi), rtol=rtol
    )
    with pytest.raises(ValueError, match="end with the event shape"):
        base.log_prob(jnp.zeros((4, 3, 2)))
    with pytest.raises(ValueError, match="tuple of positive ints"):
        flows.StandardNormal((2, 0))


def test_actnorm_init_normalises_the_batch():
    x = _x((64, 3, 3, 4), dtype=jnp.float32)
    y = flows.actnorm(*flows.actnorm_init(x), x)
    mean, std = jnp.mean(y, (0, 1, 2)), jnp.std(y, (0, 1, 2))
    np.testing.assert_allclose(mean, 0.0, atol=1e-5)  # ActNorm's float32 mean
    np.testing.assert_allclose(std, 1.0, rtol=1e-4)  # and its std


@pytest.mark.parametrize(
    "call, pattern",
    [
        (lambda: flows.squeeze(jnp.ones((2, 3, 4, 1))), "divisible by 2"),
        (lambda: flows.squeeze(jnp.ones((4, 4))), r"\[\.\.\., height"),
        (lambda: flows.squeeze(jnp.ones((1, 4, 4, 1)), 0), "positive int"),
        (lambda: flows.unsqueeze(jnp.ones((1, 2, 2, 3))), "divisible by 4"),
        (lambda: flows.split(jnp.ones((2, 3))), "even"),
        (lambda: flows.merge(jnp.ones(2), jnp.ones(3)), "one shape"),
        (
            lambda: flows.lu_conv(*_lu(3, dtype=jnp.float32), jnp.ones((2, 4))),
            "lower and upper",
        ),
        (lambda: flows.lu_conv_init(jax.random.key(0), 0), "positive int"),
        (lambda: flows.actnorm_init(jnp.ones(3)), "rank >= 2"),
    ],
)
def test_bad_input_is_refused_in_one_line(call, pattern):
    with pytest.raises(ValueError, match=pattern) as info:
        call()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "name",
    [
        "revnet.flows",
        *(f"revnet.flows.{m}" for m in ("actnorm", "squeeze", "lu_conv", "normal")),
    ],
)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testmod(module, optionflags=flags)
    assert result.attempted > 0
    assert result.failed == 0
