"""Library functions written to read their input twice, inverted in closed
form when their body is the library's: ``jnp.logaddexp`` with one operand
known, so ``jax.nn.softplus`` and ``jax.nn.log_sigmoid`` on the stream.

Checked as the rest of revnet is: the inverse, the gradient of every leaf
against ``jax.grad`` in float32 and float64, and the log-determinant against
``slogdet(jax.jacfwd)`` in float64.
"""

import jax
import jax.numpy as jnp
import pytest

import revnet
from tests.engine import flow_checks

FORMS = {
    "jax.nn.softplus": lambda w, u: jax.nn.softplus(u) * w,
    "jnp.logaddexp(u, 2)": lambda w, u: jnp.logaddexp(u, 2.0) * w,
    "jnp.logaddexp(w, u)": lambda w, u: jnp.logaddexp(w, u),
    "jax.nn.log_sigmoid": lambda w, u: jax.nn.log_sigmoid(u) * w,
}


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


def _args(dtype):
    # Inputs from -8 to 8: softplus's far tails as well as its middle.
    u = 4.0 * jax.random.normal(jax.random.PRNGKey(0), (3, 4), dtype)
    w = 1.0 + jax.random.uniform(jax.random.PRNGKey(1), (4,), dtype)
    return w, u


(
    test_the_unknown_is_rebuilt,
    test_gradients_of_every_leaf_equal_autodiff,
    test_log_det_equals_slogdet_of_the_jacobian,
) = flow_checks.form_tests(FORMS, _args)


def test_a_softplus_coupling_in_a_scan():
    """A coupling whose scale is ``softplus`` of a network, and a ``softplus``
    on the stream, in a ``lax.scan``: gradients and the log-determinant."""

    def flow(ws, x):
        def layer(h, w):
            a, b = jnp.split(h, 2, -1)
            b = b * jax.nn.softplus(a @ w) + jnp.tanh(a)
            return jnp.concatenate([jax.nn.softplus(b), a], -1), None

        return jax.lax.scan(layer, x, ws)[0]

    ws = 0.3 * jax.random.normal(jax.random.PRNGKey(2), (3, 2, 2), jnp.float64)
    x = jax.random.normal(jax.random.PRNGKey(3), (5, 4), jnp.float64)
    flow_checks.assert_flow_in_a_scan(flow, ws, x)


def test_a_function_named_logaddexp_with_another_body_is_not_recognised():
    """Recognition is by the body: a ``custom_jvp`` function that is only
    called ``logaddexp`` (here a max, which loses information) is refused."""

    @jax.custom_jvp
    def logaddexp(a, b):
        return jnp.maximum(a, b) + 0.0 * jnp.abs(a - b)

    logaddexp.defjvp(lambda p, t: (logaddexp(*p), t[0]))
    f = revnet.invertible(lambda u: logaddexp(u, 0.0))
    with pytest.raises(revnet.NotInvertibleError):
        f(jnp.ones(3))


def test_both_operands_unknown_is_refused():
    f = revnet.invertible(lambda u, v: (jnp.logaddexp(u, v), u - v))
    with pytest.raises(revnet.NotInvertibleError):
        f(jnp.ones(3), jnp.zeros(3))
