"""The examples in the blocks' docstrings run and print what they show."""

from __future__ import annotations

import doctest
import importlib

import haiku as hk
import jax
import jax.numpy as jnp
import pytest

from revnet import blocks

MODULES = ["coupling", "flow", "sequence", "permutation", "revnet", "transformer"]


@pytest.mark.parametrize("name", MODULES)
@pytest.mark.slow
def test_docstring_examples(name):
    module = importlib.import_module(f"revnet.blocks.{name}")
    names = {n: getattr(blocks, n) for n in blocks.__all__}
    result = doctest.testmod(
        module,
        extraglobs={"hk": hk, "jax": jax, "jnp": jnp, **names},
        optionflags=doctest.NORMALIZE_WHITESPACE,
    )
    assert result.attempted > 0
    assert result.failed == 0
