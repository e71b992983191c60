"""The checks a flow layer ``f(w, u)`` (``w`` known) passes: its inverse, the
gradient of every leaf against ``jax.grad`` in float32 and float64, and its
log-determinant against ``slogdet(jax.jacfwd)`` per example in float64."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import revnet
from tests.helpers import assert_trees_close, per_example_slogdet, tolerance

LOG_DET = {
    "rtol": tolerance("float64", "log_det"),
    "atol": tolerance("float64", "log_det_floor"),
}


def assert_inverts(f: Callable, w, u, what: str) -> None:
    """``revnet.inverse`` of ``f`` gives ``u`` back from ``f(w, u)``."""
    (back,) = revnet.inverse(f, w, u, known_argnums=(0,))(f(w, u))[1:]
    assert_trees_close(back, u, tolerance(u.dtype, "round_trip"), what)


def assert_gradients_are_autodiffs(f: Callable, w, u, what: str) -> None:
    """The gradients of ``sum(sin(f(w, u)))`` through ``revnet.invertible``
    equal ``jax.grad``'s, for ``w`` and ``u``."""
    inv = revnet.invertible(f, known_argnums=(0,))

    def loss(g):
        return lambda w, u: jnp.sum(jnp.sin(g(w, u)))

    got = jax.grad(loss(inv), argnums=(0, 1))(w, u)
    want = jax.grad(loss(f), argnums=(0, 1))(w, u)
    assert_trees_close(got, want, tolerance(u.dtype), what)


def assert_log_det_is_slogdets(f: Callable, w, u) -> None:
    """``forward_and_log_det(f, batch_ndim=1)`` equals ``f`` and one
    ``slogdet(jacfwd)`` per example (float64)."""
    y, log_det = revnet.forward_and_log_det(f, w, u, known_argnums=(0,), batch_ndim=1)
    np.testing.assert_allclose(y, f(w, u), rtol=tolerance("float64", "values"))
    np.testing.assert_allclose(log_det, per_example_slogdet(f, (w,), u), **LOG_DET)


def assert_flow_in_a_scan(flow: Callable, ws, x) -> None:
    """All three checks' log-det and gradients for a flow over stacked ``ws``
    (float64 ``ws`` and ``x``; gradients in float32 and float64)."""
    assert_log_det_is_slogdets(flow, ws, x)
    inv = revnet.invertible(flow, known_argnums=(0,))
    for dtype in (jnp.float32, jnp.float64):
        a = (ws.astype(dtype), x.astype(dtype))
        got = jax.grad(lambda *a: jnp.sum(inv(*a) ** 2), argnums=(0, 1))(*a)
        want = jax.grad(lambda *a: jnp.sum(flow(*a) ** 2), argnums=(0, 1))(*a)
        assert_trees_close(got, want, tolerance(dtype), str(dtype))


def form_tests(forms: dict[str, Callable], args: Callable) -> tuple[Callable, ...]:
    """The three tests of a table of flow layers ``forms`` (name -> ``f(w,
    u)``) at ``args(dtype) -> (w, u)``: the inverse, the gradients in float32
    and float64, the log-determinant. A test module binds them to names
    starting with ``test_``."""
    names = pytest.mark.parametrize("name", list(forms))

    @names
    def test_the_unknown_is_rebuilt(name):
        assert_inverts(forms[name], *args(jnp.float64), name)

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
    @names
    def test_gradients_of_every_leaf_equal_autodiff(name, dtype):
        assert_gradients_are_autodiffs(forms[name], *args(dtype), name)

    @names
    def test_log_det_equals_slogdet_of_the_jacobian(name):
        assert_log_det_is_slogdets(forms[name], *args(jnp.float64))

    return (
        test_the_unknown_is_rebuilt,
        test_gradients_of_every_leaf_equal_autodiff,
        test_log_det_equals_slogdet_of_the_jacobian,
    )
