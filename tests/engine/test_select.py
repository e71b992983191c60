"""``select_n`` whose predicate is computed from the value it selects on
(revnet/_engine/structural/select.py): leaky ReLU and its kin are inverted by
consistency, store nothing, and a select that is not injective is reported."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import revnet
from tests.helpers import (
    assert_trees_close,
    check_against_autodiff,
    cotangents_like,
    per_example_slogdet,
    runtime_checks,
    slogdet_reference,
    tolerance,
)

DTYPES = ["float32", "float64"]
# Injective selects whose predicate reads the selected-on value itself.
SELECTS = {
    "leaky_relu": lambda x: jax.nn.leaky_relu(x, 0.1),
    # A nested "safe where" on the same predicate inside one case.
    "elu": jax.nn.elu,
    "selu": jax.nn.selu,
    "where_gt": lambda x: jnp.where(x > 0, x, 0.1 * x),
    "two_pieces": lambda x: jnp.where(x >= 0, 2 * x + 1, jnp.exp(x)),
    "jump": lambda x: jnp.where(x > 1, 3 * x - 2, x / 2),
    "negative_slope": lambda x: jnp.where(x < 0.5, -x, 0.5 - 2 * x),
}


def _x(dtype):
    finfo = jnp.finfo(dtype)
    edges = [0.0, -0.0, finfo.tiny, -finfo.tiny, 1.0, 0.5, -1.0, 1e-30, -1e-30]
    rand = jax.random.uniform(jax.random.key(0), (24,), dtype, -4, 4)
    return jnp.concatenate([jnp.asarray(edges, dtype), rand])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(SELECTS))
def test_inverse_decides_the_predicate_from_the_rebuilt_value(name, dtype):
    with jax.enable_x64(dtype == "float64"):
        f, x = SELECTS[name], _x(dtype)
        (back,) = revnet.inverse(f, x)(f(x))
        # Exact up to the rounding of each case's inverse.
        np.testing.assert_allclose(
            back,
            x,
            rtol=tolerance(dtype),
            atol=1e-30,  # for the +-1e-30 edge inputs
        )
        assert jnp.all(jnp.isfinite(back))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["leaky_relu", "elu", "two_pieces", "negative_slope"])
def test_gradients_equal_autodiff_and_nothing_is_stored(name, dtype):
    """On the stream, a continuous select (a kink) is inverted without its
    predicate, so no mask is kept per layer; gradients are plain JAX's."""
    with jax.enable_x64(dtype == "float64"):
        x = jax.random.uniform(jax.random.key(1), (3, 8), dtype, -2, 2)

        def f(x):
            for _ in range(4):
                x = SELECTS[name](x) * 1.5 + 0.1
            return x

        check_against_autodiff(f, x)
        kept = revnet.stored(revnet.invertible(f), x)
        # The output, and the input the boundary check compares with: no mask.
        assert [k.kind for k in kept.entries] == ["output", "checked input"], kept


def test_a_jump_is_still_stored_by_default():
    """A real decision (the cases differ where the predicate switches) keeps
    its stored predicate: the backward pass follows the forward's branch."""
    f = SELECTS["jump"]
    x = jnp.linspace(-3.0, 3.0, 16)
    kept = revnet.stored(revnet.invertible(f), x)
    assert "decision" in [k.kind for k in kept.entries], kept
    check_against_autodiff(f, x)
    # Recomputed, it is decided from the rebuilt value instead.
    g = revnet.invertible(f, decisions="recompute")
    assert_trees_close(
        jax.grad(lambda x: g(x).sum())(x),
        jax.grad(lambda x: f(x).sum())(x),
        tolerance("float32"),
        "gradient",
    )


def test_a_select_that_is_not_injective_gives_nan_and_is_reported():
    def f(x):
        return jnp.where(x > 0, x, -x)  # |x|: two inputs per output

    x = jnp.array([-2.0, 0.0, 3.0])
    with runtime_checks(False):
        (back,) = revnet.inverse(f, x)(f(x))
    assert jnp.isnan(back[0]) and jnp.isnan(back[2]) and back[1] == 0, back
    with runtime_checks(True):
        with pytest.raises(revnet.NotInvertibleError) as err:
            jax.block_until_ready(revnet.inverse(f, x)(f(x)))
    text = str(err.value)
    assert "`select_n` at" in text and "test_select.py" in text, text
    assert "not injective" in text and "\n" not in text


def test_an_output_outside_the_range_gives_nan():
    f = SELECTS["two_pieces"]  # maps onto (0, inf): -1 is no output
    x = jnp.zeros(3)
    with runtime_checks(False):
        (back,) = revnet.inverse(f, x)(jnp.array([-1.0, 0.5, 2.0]))
    assert jnp.isnan(back[0]), back
    want = [np.log(0.5), 0.5]
    np.testing.assert_allclose(back[1:], want, rtol=tolerance("float32", "values"))


def test_a_predicate_reading_another_unknown_is_still_refused():
    def f(x, y):  # y is rebuilt from x, x by a select on y
        return jnp.where(y > 0, 2 * x, x / 2), y + x

    x = jnp.ones(3)
    with pytest.raises(revnet.NotInvertibleError, match="not a function of the "):
        revnet.inverse(f, x, x)


def test_a_case_undefined_elsewhere_does_not_trip_the_run_time_checks():
    """The exp case's inverse (log) is NaN where x is negative, but that
    candidate is not the one kept: checks only look where a case is picked."""

    def f(x):
        return jnp.where(x > 0, jnp.exp(x), x)

    x = jnp.array([-3.0, -0.5, 0.25, 2.0])
    with runtime_checks(True):
        (back,) = jax.block_until_ready(revnet.inverse(f, x)(f(x)))
    np.testing.assert_allclose(back, x, rtol=tolerance("float32", "values"))


def test_candidates_rounded_across_a_continuous_switch_are_kept():
    """selu(tiny): one candidate flushes to zero, the other stays tiny; both
    are the switching point to rounding, so the value is kept, not NaN."""
    tiny = jnp.finfo(jnp.float32).tiny
    x = jnp.array([tiny, -tiny, 0.0])
    with runtime_checks(True):
        (back,) = jax.block_until_ready(revnet.inverse(jax.nn.selu, x)(jax.nn.selu(x)))
    np.testing.assert_allclose(back, x, atol=2 * tiny)  # subnormal inputs


# Where a flow meets them: the log-determinant's terms read the predicate too,
# so it is stored (in a loop, once a step: the StoredGrowthWarning), and a
# nested select on it (elu's safe where) is followed on the same side as with
# the predicate unknown.
GROWS = "ignore::revnet.StoredGrowthWarning"
LOG_DET_SELECTS = {
    "elu": jax.nn.elu,
    "selu": jax.nn.selu,
    # celu's select form: its safe where reads its own copy of the predicate.
    "celu_where": lambda x: jnp.where(
        x > 0, x, 0.7 * jnp.expm1(jnp.where(x > 0, 0.0, x) / 0.7)
    ),
}


def _layer(name):
    return lambda h: LOG_DET_SELECTS[name](h) * 1.5 + 0.1


def _log_det_forms(name):
    """``(revnet's form, plain JAX's)`` of each way a flow takes a log-det of
    the select: ``forward_and_log_det`` of an ``@invertible`` function, and
    the README's pattern (a per-example log-det carried through a scan)."""

    def one(wrap):
        return lambda x: revnet.forward_and_log_det(wrap(_layer(name)), x)

    def carried(x):
        def layer(carry, _):
            h, total = carry
            h, ld = revnet.forward_and_log_det(_layer(name), h, batch_ndim=1)
            return (h, total + ld), None

        init = (x, jnp.zeros(x.shape[:1], x.dtype))
        return jax.lax.scan(layer, init, None, length=3)[0]

    return {
        "invertible": (one(revnet.invertible), one(lambda f: f)),
        "carried": (revnet.invertible(carried), carried),
    }


@pytest.mark.filterwarnings(GROWS)
@pytest.mark.parametrize("form", ["invertible", "carried"])
@pytest.mark.parametrize("name", sorted(LOG_DET_SELECTS))
def test_log_dets_equal_slogdet_of_the_jacobian(name, form):
    with jax.enable_x64(True):
        x = jax.random.uniform(jax.random.key(2), (3, 4), jnp.float64, -2, 2)
        rev, plain = _log_det_forms(name)[form]
        if form == "invertible":
            ref = slogdet_reference(_layer(name), (), x)
        else:
            ref = per_example_slogdet(lambda x: (plain(x)[0],), (), x)
        np.testing.assert_allclose(
            rev(x)[1],
            ref,
            rtol=tolerance("float64", "log_det"),
            atol=tolerance("float64", "log_det_floor"),
        )


@pytest.mark.filterwarnings(GROWS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", ["invertible", "carried"])
@pytest.mark.parametrize("name", sorted(LOG_DET_SELECTS))
def test_log_det_gradients_equal_autodiff(name, form, dtype):
    with jax.enable_x64(dtype == "float64"):
        x = jax.random.uniform(jax.random.key(3), (3, 4), dtype, -2, 2)
        rev, plain = _log_det_forms(name)[form]
        out, vjp = jax.vjp(plain, x)
        rout, rvjp = jax.vjp(rev, x)
        assert_trees_close(rout, out, tolerance(dtype), "output")
        cts = cotangents_like(out)
        assert_trees_close(rvjp(cts), vjp(cts), tolerance(dtype), "cotangent")
