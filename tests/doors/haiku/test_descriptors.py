"""Generic checks over every block module (see ``descriptors.py``)."""

from __future__ import annotations

import functools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revnet import blocks
from revnet._layers.precision import cast_floats
from tests.doors.haiku.descriptors import (
    ENTRIES,
    EXCUSED,
    Entry,
    described_types,
)
from tests.helpers import assert_trees_close, tolerance

TWINS = [e for e in ENTRIES if e.has_twin]
RNG = jax.random.PRNGKey(2)


def transformed(entry: Entry, reversible: bool = True, method: str = "call"):
    def fn(x):
        return getattr(entry, method)(entry.make(reversible), x)

    return hk.transform_with_state(fn)


@functools.cache
def setup(entry: Entry):
    """Input, parameters and state in float32 (initialised once per entry)."""
    x = jax.random.normal(jax.random.PRNGKey(1), entry.shape)
    params, state = jax.jit(transformed(entry).init)(jax.random.PRNGKey(0), x)
    return x, params, state


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
@pytest.mark.slow
def test_jit_matches_eager_and_inverse_round_trips(entry):
    x, params, state = setup(entry)
    forward = transformed(entry, method="forward").apply
    inverse = transformed(entry, method="inverse").apply
    results = []
    for run in (lambda f: f, jax.jit):
        y, new_state = run(forward)(params, state, RNG, x)
        # The same RNG key replays the same dropout masks in the inverse.
        rebuilt, _ = run(inverse)(params, state, RNG, y)
        results.append((y, new_state, rebuilt))
    # Not bitwise: XLA fuses differently under jit. Each array is compared
    # elementwise, with an absolute term relative to its largest value.
    for jitted, eager in zip(*map(jax.tree.leaves, results), strict=True):
        if np.any(eager):
            assert_trees_close(jitted, eager, rtol=1e-5, floor=1.0)  # jit vs eager
        else:
            np.testing.assert_array_equal(jitted, eager)
    target = entry.round_trip_target(x, y)
    assert rebuilt.shape == target.shape and rebuilt.dtype == target.dtype
    tol = tolerance(jnp.float32, "round_trip")
    np.testing.assert_allclose(rebuilt, target, rtol=tol, atol=tol)
    assert not np.allclose(y, x) if y.shape == x.shape else True


@pytest.mark.parametrize("entry", TWINS, ids=lambda e: e.name)
def test_twin_has_the_same_parameter_tree(entry):
    x = jax.ShapeDtypeStruct(entry.shape, jnp.float32)
    key = jax.random.PRNGKey(0)
    rev = jax.eval_shape(transformed(entry, True).init, key, x)
    std = jax.eval_shape(transformed(entry, False).init, key, x)
    assert rev == std


def twin_gradients(entry: Entry, dtype, rtol: float) -> None:
    x, params, state = cast_floats(setup(entry), dtype)

    def grads(reversible):
        apply = transformed(entry, reversible).apply

        def loss(params, x):
            y, new_state = apply(params, state, RNG, x)
            return jnp.sum(jnp.sin(y)), (y, new_state)

        return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(params, x)

    (g_rev, aux_rev), (g_std, aux_std) = grads(True), grads(False)
    assert jax.tree.leaves(g_rev)[0].dtype == dtype
    assert_trees_close(g_rev, g_std, rtol)
    assert_trees_close(aux_rev, aux_std, rtol)


@pytest.mark.parametrize("entry", TWINS, ids=lambda e: e.name)
@pytest.mark.slow
def test_gradients_match_twin_float32(entry):
    twin_gradients(entry, jnp.float32, tolerance(jnp.float32))


@pytest.mark.parametrize("entry", TWINS, ids=lambda e: e.name)
@pytest.mark.slow
def test_gradients_match_twin_float64(entry):
    with jax.enable_x64(True):
        twin_gradients(entry, jnp.float64, tolerance(jnp.float64))


def test_every_exported_module_is_described():
    """Each name in ``revnet.blocks.__all__`` has an entry or an excuse."""
    described = {t.__name__ for t in described_types()}
    exported = set(blocks.__all__)
    missing = sorted(exported - described - set(EXCUSED))
    assert not missing, f"add descriptor entries (or excuses) for {missing}"
    stale = sorted(set(EXCUSED) & described)
    assert not stale, f"{stale} have entries now; remove their excuses"
    unknown = sorted(set(EXCUSED) - exported)
    assert not unknown, f"{unknown} are excused but not exported"
    assert all(isinstance(r, str) and r for r in EXCUSED.values())
    # Every described type is exported, under its own name.
    assert all(getattr(blocks, name, None) is not None for name in described)
