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
