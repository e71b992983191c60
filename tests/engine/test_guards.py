"""NaN/Inf guards: a guard over a region stays a guard (recomputed); a guard
of a value made non-finite only at a tie (``0/0``) is a decision (stored), or
the rebuilt value misses the tie and the guarded branch jumps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core

import revnet
from revnet._engine import expose, trace
from revnet._engine.decisions import guards
from tests.engine.test_continuity import _elementwise_cases, _params
from tests.helpers import assert_trees_close, tolerance


def _last_eqn(f, arity):
    x = jnp.full((4,), 0.5)
    return jax.make_jaxpr(f)(*[x] * arity).jaxpr.eqns[-1]


@pytest.mark.parametrize(
    "f, arity, nan, nonfinite",
    [
        (lambda a, b: a / b, 2, guards.TIE, guards.TIE),  # 0/0, c/0
        (lambda a, b: jax.lax.rem(a, b), 2, guards.TIE, guards.TIE),  # x rem 0
        (lambda a: 1.0 / a, 1, guards.NONE, guards.TIE),  # 1/0 is inf, never NaN
        (jnp.sqrt, 1, guards.REGION, guards.REGION),  # every negative value
        (jnp.log, 1, guards.REGION, guards.REGION),
        (jnp.exp, 1, guards.NONE, guards.REGION),  # overflow, never NaN
        (lambda a, b: a * b, 2, guards.NONE, guards.NONE),
        (jnp.tanh, 1, guards.NONE, guards.NONE),
        (jax.scipy.special.digamma, 1, guards.TIE, guards.TIE),  # poles at -n
    ],
    ids=["div", "rem", "1/x", "sqrt", "log", "exp", "mul", "tanh", "digamma"],
)
def test_where_an_equation_makes_non_finite_values(f, arity, nan, nonfinite):
    eqn = _last_eqn(f, arity)
    assert guards._kind(eqn, "nan") == nan
    assert guards._kind(eqn, "nonfinite") == nonfinite


def test_the_kind_of_every_elementwise_primitive_agrees_with_its_values():
    """On every float elementwise primitive JAX binds: one found non-finite
    at a tie is finite on a fine grid that avoids the grid's exact points, and
    non-finite at one of them; one found non-finite on a region is so on the
    grid's samples too (a rule checked against what each computes)."""
    with jax.enable_x64(True):
        cases = _elementwise_cases()
        assert len(cases) >= 40
        kinds = {}
        for name, prim, arity in cases:
            x = jnp.full((4,), 0.5, jnp.float64)
            closed = jax.make_jaxpr(lambda *a: prim.bind(*a, **_params(name)))(
                *[x] * arity
            )
            (eqn,) = closed.jaxpr.eqns
            kinds[name] = kind = guards._kind(eqn, "nan")
            # Points between the grid's exact values: no tie among them.
            t = np.linspace(-3.3, 3.3, 2_001) + 1e-3 * np.pi
            args = [jnp.asarray(t)] + [jnp.full_like(t, 0.7 + 1e-4)] * (arity - 1)
            try:
                y = np.asarray(prim.bind(*args, **_params(name)))
            except Exception:
                continue
            if kind in (guards.TIE, guards.NONE):
                assert not np.isnan(y).any(), (name, kind)
    assert kinds["div"] == kinds["rem"] == guards.TIE, kinds
    assert kinds["sqrt"] == kinds["log"] == guards.REGION, kinds
    assert kinds["exp"] == kinds["tanh"] == kinds["mul"] == guards.NONE, kinds
    assert all(isinstance(p, jex_core.Primitive) for _, p, _ in cases)


def _block(w, x):
    a, b = jnp.split(x, 2, -1)
    u = a / jnp.where(a == 0, 0.0, a)  # NaN exactly where a == 0, else 1
    g = jnp.where(jnp.isnan(u), 0.0, u)
    return jnp.concatenate([b + g * jnp.tanh(a @ w), a], -1)


def _net(ws, x):
    return jax.lax.scan(lambda h, w: (_block(w, h), None), x, ws)[0]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_a_nan_guard_at_a_tie_is_stored_and_the_gradient_is_autodiffs(dtype):
    """The input has exact zeros, where the guard picks 0; rebuilt, they are
    off by rounding and a recomputed guard would pick 1: the weights'
    gradient was 3% off, silently. Stored, it equals plain autodiff's. Where
    autodiff's input gradient is NaN (its 0/0 at the tie), a recomputed kink
    (``where(a == 0, 0, a)`` is ``a``) differentiates off the tie, as kinks
    do; with ``kinks="store"`` it is NaN there too."""
    with jax.enable_x64(dtype == jnp.float64):
        ws = jax.random.normal(jax.random.PRNGKey(0), (3, 4, 4), dtype)
        x = jax.random.normal(jax.random.PRNGKey(1), (5, 8), dtype)
        x = x.at[:, 0].set(0.0).at[:, 5].set(0.0)

        def loss(f):
            return lambda ws, x: jnp.sum(jnp.sin(f(ws, x)))

        rw, rx = jax.grad(loss(_net), (0, 1))(ws, x)
        finite = ~np.isnan(np.asarray(rx))
        for kinks in ("recompute", "store"):
            inv = revnet.invertible(_net, known_argnums=(0,), kinks=kinks)
            gw, gx = jax.grad(loss(inv), (0, 1))(ws, x)
            assert_trees_close(gw, rw, tolerance(dtype), f"weights, {kinks}")
            np.testing.assert_allclose(
                np.asarray(gx)[finite],
                np.asarray(rx)[finite],
                rtol=tolerance(dtype),
                atol=tolerance(dtype) * float(np.max(np.abs(np.asarray(rx)[finite]))),
            )
            if kinks == "store":  # the tie's 0/0 differentiated as autodiff does
                np.testing.assert_array_equal(np.isnan(gx), ~finite)


def _kept(f, x):
    jaxpr, consts, _ = trace(f, [x])
    return expose(jaxpr, [False] * len(consts) + [True]).kept


def test_a_guard_over_a_region_is_not_stored():
    """``sqrt`` is NaN on every negative value: the guard's branch is taken
    on a region that rebuilt values approach continuously (the guarded value
    is 0 at its edge), so nothing is stored."""

    def region(x):
        r = jnp.sqrt(x)
        return x + jnp.where(jnp.isnan(r), 0.0, r)

    def tie(x):
        u = x / jnp.where(x == 0, 0.0, x)
        return x + jnp.where(jnp.isnan(u), 0.0, u)

    x = jnp.linspace(-1.0, 1.0, 8)
    assert not _kept(region, x)
    assert len(_kept(tie, x)) == 1
