"""Linear elimination: unknowns tied linearly across equations are solved
together (``revnet._engine.elimination``), and what it does not solve is
refused as before.

Values, inverses and VJPs are checked against plain JAX in float32 and
float64 (``check_against_autodiff``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import revnet
from revnet._engine import analysis
from revnet._engine.elimination import Eliminate
from tests.helpers import check_against_autodiff

DTYPES = ["float32", "float64"]


def _plan_steps(fun, *args):
    jaxpr = jax.make_jaxpr(fun)(*args).jaxpr
    n_in, n_out = len(jaxpr.invars), len(jaxpr.outvars)
    return analysis.analyze(jaxpr, (False,) * n_in, (True,) * n_out).steps


def _args(dtype, n=5):
    return (
        jnp.linspace(-1.0, 1.0, n, dtype=dtype),
        jnp.linspace(0.5, -0.3, n, dtype=dtype),
    )


def _sum_and_difference(a, b):
    return a + b, a - 2.0 * b


@pytest.mark.parametrize("dtype", DTYPES)
def test_two_unknowns_in_two_linear_equations_are_solved_together(dtype):
    with jax.enable_x64(dtype == "float64"):
        args = _args(dtype)
        assert any(
            isinstance(s, Eliminate) for s in _plan_steps(_sum_and_difference, *args)
        )
        check_against_autodiff(_sum_and_difference, *args)


def _leapfrog(h):
    """Velocity Verlet in its natural form: the old acceleration appears in
    both equations and cancels from ``x1 - h v1``."""

    def acc(x):
        return -jnp.sin(x) - 0.1 * x

    def step(x, v):
        x1 = x + h * v + 0.5 * h * h * acc(x)
        v1 = v + 0.5 * h * (acc(x) + acc(x1))
        return x1, v1

    return step


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", ["python float", "array"])
def test_a_leapfrog_in_its_natural_form_inverts(dtype, h):
    with jax.enable_x64(dtype == "float64"):
        # An array's coefficients cancel symbolically (h*h/2 - h*(h/2)); a
        # Python float's were rounded to the dtype before tracing and cancel
        # to within a few roundings.
        step = _leapfrog(0.1 if h == "python float" else jnp.asarray(0.1, dtype))
        check_against_autodiff(step, *_args(dtype))


def test_a_residual_is_still_refused():
    def residual(x, y):
        return x + jnp.sin(x), y + jnp.cos(x)

    with pytest.raises(revnet.NotInvertibleError, match="residual"):
        revnet.inverse(residual, *_args("float32"))


def test_a_singular_system_is_refused():
    def singular(a, b):
        return a + b, 2.0 * a + 2.0 * b

    with pytest.raises(revnet.NotInvertibleError):
        revnet.inverse(singular, *_args("float32"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_small_real_difference_of_coefficients_is_not_taken_for_zero(dtype):
    # Determinant 1e-3: far above rounding, so the system is solved.
    def close(a, b):
        return a + b, a + 1.001 * b

    with jax.enable_x64(dtype == "float64"):
        check_against_autodiff(
            close,
            *_args(dtype),
            rtol=1e-3 if dtype == "float32" else None,  # solved through det 1e-3
        )


def test_the_solved_value_matches_the_original_in_both_dtypes():
    for dtype in DTYPES:
        with jax.enable_x64(dtype == "float64"):
            a, b = _args(dtype)
            back = revnet.inverse(_sum_and_difference, a, b)(_sum_and_difference(a, b))
            assert back[0].dtype == jnp.dtype(dtype)
            atol = 4 * jnp.finfo(dtype).eps  # exact but for a 2x2 solve's rounding
            np.testing.assert_allclose(back[0], a, atol=atol)
            np.testing.assert_allclose(back[1], b, atol=atol)


def test_a_log_det_through_elimination_is_refused_in_one_line():
    with pytest.raises(revnet.NotInvertibleError) as info:
        revnet.forward_and_log_det(_sum_and_difference, *_args("float64"))
    text = str(info.value)
    assert "\n" not in text and "linear elimination" in text, text
    assert f"{__file__}:" in text, text


def test_a_narrowing_cast_is_not_taken_for_a_linear_map():
    """float32 to bfloat16 loses digits: the program stays refused, though
    its other equation ties the same unknowns linearly."""

    def narrowed(a, b):
        return a - jax.nn.relu(b) * 0.477, b.astype(jnp.bfloat16)

    with pytest.raises(revnet.NotInvertibleError):
        revnet.inverse(narrowed, *_args("float32"))
