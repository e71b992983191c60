"""Masked couplings (_engine/masks.py): RealNVP written with a binary mask,
in the forms flow code writes, is inverted with its log-determinant."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import revnet
from tests.engine import flow_checks
from tests.helpers import assert_trees_close, runtime_checks, tolerance

D = 6


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


CHECKER = np.array([1.0, 0.0, 1.0, 0.0, 1.0, 0.0])


def _st(w, h):
    """RealNVP's scale and shift networks of the masked input ``h``."""
    hidden = jnp.tanh(h @ w["w1"] + w["b1"])
    return jnp.tanh(hidden @ w["ws"]), hidden @ w["wt"]


def mul_form(w, x):
    m = CHECKER.astype(x.dtype)
    s, t = _st(w, x * m)
    return x * m + (1 - m) * (x * jnp.exp(s) + t)


def where_form(w, x):
    m = CHECKER.astype(bool)
    xm = jnp.where(m, x, 0.0)
    s, t = _st(w, xm)
    return jnp.where(m, x, x * jnp.exp(s) + t)


def where_argument(w, x):
    """A boolean mask as a known argument, with ``jnp.where``."""
    m = w["mask"] > 0
    xm = jnp.where(m, x, 0.0)
    s, t = _st(w, xm)
    return jnp.where(m, x, x * jnp.exp(s) + t)


def mask_argument(w, x):
    """The mask a known argument (a leaf of ``w``): the plan holds for any
    binary mask."""
    m = w["mask"]
    s, t = _st(w, x * m)
    return x * m + (1 - m) * (x * jnp.exp(s) + t)


def within_a_flow(w, x):
    """A scale before and a leaky ReLU after: the leaky ReLU's select chains
    run on through the coupling's select, and its log-det term stops at the
    value it rebuilds."""
    return jax.nn.leaky_relu(where_form(w, x * 1.7), 0.3)


def same_mask_twice(w, x):
    """Two couplings on one mask: the second's masked input is the first's."""
    return mul_form(w, mul_form(w, x))


FORMS = {
    "mul": mul_form,
    "where": where_form,
    "where_argument": where_argument,
    "within_a_flow": within_a_flow,
    "same_mask_twice": same_mask_twice,
    "mask_argument": mask_argument,
}


def _weights(dtype, mask=CHECKER):
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    return {
        "w1": (jax.random.normal(k[0], (D, 8)) * 0.4).astype(dtype),
        "b1": (jax.random.normal(k[1], (8,)) * 0.1).astype(dtype),
        "ws": (jax.random.normal(k[2], (8, D)) * 0.4).astype(dtype),
        "wt": (jax.random.normal(k[3], (8, D)) * 0.4).astype(dtype),
        "mask": jnp.asarray(mask, dtype),
    }


def _args(dtype):
    x = jax.random.normal(jax.random.PRNGKey(1), (5, D)).astype(dtype)
    return _weights(dtype), x


(
    test_the_unknown_is_rebuilt,
    test_gradients_of_every_leaf_equal_autodiff,
    test_log_det_equals_slogdet_of_the_jacobian,
) = flow_checks.form_tests(FORMS, _args)


def test_any_binary_mask_with_one_plan():
    """The mask's values do not choose the plan: its complement, and masks
    of all ones and all zeros, are inverted by the same one, with their
    log-dets."""
    _, x = _args(jnp.float64)
    for mask in (1.0 - CHECKER, np.ones(D), np.zeros(D)):
        for form in (mask_argument, where_argument):
            w = _weights(jnp.float64, mask)
            flow_checks.assert_inverts(form, w, x, str(mask))
            flow_checks.assert_log_det_is_slogdets(form, w, x)


def test_a_stack_of_masked_couplings_in_a_scan():
    """Alternating masks, one per layer of a ``lax.scan``."""

    def flow(ws, x):
        def layer(x, w):
            return mask_argument(w, x), None

        return jax.lax.scan(layer, x, ws)[0]

    _, x = _args(jnp.float64)
    masks = [CHECKER if i % 2 else 1.0 - CHECKER for i in range(4)]
    layers = [_weights(jnp.float64, m) for m in masks]
    ws = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *layers)
    flow_checks.assert_inverts(flow, ws, x, "stack")
    flow_checks.assert_log_det_is_slogdets(flow, ws, x)
    for dtype in (jnp.float32, jnp.float64):
        cast = jax.tree_util.tree_map(lambda a: a.astype(dtype), (ws, x))
        flow_checks.assert_gradients_are_autodiffs(flow, *cast, str(dtype))


def test_a_mask_that_is_not_binary_is_reported():
    """The plan holds for binary masks; another makes the rebuilt values NaN
    (never a silently wrong inverse), and the run-time checks name it."""
    w, x = _args(jnp.float64)
    w["mask"] = w["mask"] * 0.5
    y = mask_argument(w, x)
    with runtime_checks(False):
        back = revnet.inverse(mask_argument, w, x, known_argnums=(0,))(y)[1]
    assert bool(jnp.all(jnp.isnan(back)))
    with runtime_checks(True):
        with pytest.raises(revnet.NotInvertibleError, match="other than 0 and 1"):
            jax.block_until_ready(
                revnet.inverse(mask_argument, w, x, known_argnums=(0,))(y)
            )


def test_a_conditioner_reading_the_whole_input_is_refused():
    """``s(x)`` instead of ``s(x * m)``: not a coupling, refused."""

    def f(w, x):
        m = CHECKER.astype(x.dtype)
        s, t = _st(w, x)
        return x * m + (1 - m) * (x * jnp.exp(s) + t)

    w, x = _args(jnp.float32)
    with pytest.raises(revnet.NotInvertibleError):
        revnet.inverse(f, w, x, known_argnums=(0,))


def test_gradients_through_a_masked_stack_in_float32():
    inv = revnet.invertible(mask_argument, known_argnums=(0,))
    w, x = _args(jnp.float32)
    got = jax.grad(lambda w, x: jnp.sum(inv(w, x) ** 2), argnums=(0, 1))(w, x)
    want = jax.grad(lambda w, x: jnp.sum(mask_argument(w, x) ** 2), argnums=(0, 1))(
        w, x
    )
    assert_trees_close(got, want, tolerance(jnp.float32))
