"""An unknown solved from a quotient of two affine forms of it (a Möbius map),
or from a difference of their logarithms: logit in the forms flow code
writes it, and the preprocessing ``logit(alpha + (1 - 2 alpha) x)``.

Each is checked as the rest of revnet is: the inverse, the gradient of every
leaf against ``jax.grad`` in float32 and float64, and the log-determinant
against ``slogdet(jax.jacfwd)`` in float64.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.scipy.special import logit

import revnet
from revnet._engine import ratios
from revnet._engine.analysis import analyze
from tests.engine import flow_checks
from tests.helpers import equations

ALPHA = 0.05


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


def _known_weight_mobius(w, u):
    # Coefficients from a weight (not a trace-time value): (w u + 1) / (u + 2)
    # is one-to-one where 2 w - 1 is not zero.
    return (w * u + 1.0) / (u + 2.0)


FORMS = {
    "jax.scipy.special.logit": lambda w, u: logit(u) * w,
    "log(u) - log1p(-u)": lambda w, u: (jnp.log(u) - jnp.log1p(-u)) * w,
    "log(u / (1 - u))": lambda w, u: jnp.log(u / (1 - u)) * w,
    "preprocessing logit(alpha + (1 - 2 alpha) x)": lambda w, u: (
        logit(ALPHA + (1 - 2 * ALPHA) * u) * w
    ),
    "scaled logs 2 log(u + 0.5) - 2 log(1.5 - u)": lambda w, u: (
        (2.0 * jnp.log(u + 0.5) - 2.0 * jnp.log(1.5 - u)) * w
    ),
    "a quotient with a weight's coefficients": _known_weight_mobius,
}


def _args(dtype, batch=3, width=4):
    u = jax.random.uniform(jax.random.PRNGKey(0), (batch, width), dtype, 0.05, 0.95)
    w = 1.5 + jax.random.uniform(jax.random.PRNGKey(1), (width,), dtype)
    return w, u


(
    test_the_unknown_is_rebuilt,
    test_gradients_of_every_leaf_equal_autodiff,
    test_log_det_equals_slogdet_of_the_jacobian,
) = flow_checks.form_tests(FORMS, _args)


def test_a_logit_flow_layer_before_a_coupling_in_a_scan():
    """Logit preprocessing, then affine couplings in a ``lax.scan``: the
    flow's log-determinant and its weights' gradients."""

    def flow(ws, x):
        h = logit(ALPHA + (1 - 2 * ALPHA) * x)

        def layer(h, w):
            a, b = jnp.split(h, 2, -1)
            s = jnp.tanh(a @ w)
            return jnp.concatenate([b * jnp.exp(s) + s, a], -1), None

        return jax.lax.scan(layer, h, ws)[0]

    ws = 0.3 * jax.random.normal(jax.random.PRNGKey(2), (3, 2, 2), jnp.float64)
    x = jax.random.uniform(jax.random.PRNGKey(3), (5, 4), jnp.float64, 0.01, 0.99)
    flow_checks.assert_flow_in_a_scan(flow, ws, x)


def test_a_quotient_that_does_not_depend_on_its_unknown_is_refused():
    """``2 u / u`` is constant: its coefficients are trace-time numbers with
    ``a d - b c = 0``, so it is refused when traced, as before."""
    f = revnet.invertible(lambda u: (2.0 * u) / u)
    with pytest.raises(revnet.NotInvertibleError, match="cannot solve `div`"):
        f(jnp.ones(3))


def test_a_product_of_two_forms_is_not_taken_for_a_quotient():
    """``u * (1 - u)`` is not one-to-one: no quotient step may solve it."""
    f = revnet.invertible(lambda u: u * (1.0 - u))
    with pytest.raises(revnet.NotInvertibleError, match="`mul`"):
        f(jnp.full(3, 0.25))


def test_the_step_reads_the_quotient_once():
    """The rebuilt program evaluates the quotient's solution, not a search:
    the step is one :class:`ratios.Ratio` per logit."""
    f = FORMS["log(u / (1 - u))"]
    w, u = _args(jnp.float64)
    jaxpr = jax.make_jaxpr(lambda w, u: f(w, u))(w, u).jaxpr
    steps = analyze(jaxpr, (True, False), (True,)).steps
    assert sum(isinstance(s, ratios.Ratio) for s in steps) == 1, steps
    assert any(e.primitive.name == "div" for e in equations(f, w, u))


def test_a_sum_deeper_than_the_stack_is_refused_not_a_crash():
    """4,000 terms of one unknown: the searches for a quotient and a mask
    give up past Python's stack, and the refusal is the usual line."""

    def f(x):
        acc = x * jnp.array([1.0, 0.0, 1.0, 0.0])
        for _ in range(4000):
            acc = acc + x * 1e-4
        return acc

    with pytest.raises(revnet.NotInvertibleError, match="cannot solve `add`"):
        revnet.inverse(f, jnp.ones(4))
