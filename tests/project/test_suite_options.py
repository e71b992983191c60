"""The suite's own options (tests/conftest.py): XLA's optimisations are off for
speed, except in tests marked ``optimized``."""

import os

import jax
import pytest


def test_xla_optimisations_follow_the_environment():
    off = os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] not in ("0", "false", "False")
    assert jax.config.read("jax_disable_most_optimizations") == off


@pytest.mark.optimized
def test_a_test_marked_optimized_compiles_with_them():
    assert jax.config.read("jax_disable_most_optimizations") is False


def test_clearing_the_caches_unmaps_compiled_programs():
    """The premise of tests/conftest.py's cache clearing: each compiled program
    holds memory mappings until JAX's caches are cleared."""
    from tests.conftest import mappings, release_compiled_programs

    if mappings() is None:
        pytest.skip("no /proc/self/maps on this platform")
    release_compiled_programs()
    before = mappings()
    kept = [jax.jit(lambda x, k=k: x * k + 1.0) for k in range(200)]
    for f in kept:
        f(jax.numpy.ones(2)).block_until_ready()
    grown = mappings()
    assert grown - before >= 200, (before, grown)  # at least one per program
    release_compiled_programs()
    assert mappings() - before < (grown - before) / 4, (before, grown, mappings())
