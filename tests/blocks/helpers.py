"""Shared helpers for the block tests: tree comparison and compiled metrics."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def assert_trees_close(actual: Any, expected: Any, rtol: float, floor=0.1) -> None:
    """Elementwise comparison of two gradient trees.

    Each leaf is compared with ``rtol`` relative to its own elements plus an
    absolute term ``rtol * max(leaf_max, floor * tree_max)``. The floor matters
    for leaves whose true gradient is zero in theory (a bias feeding a
    BatchNorm): their values are rounding noise, so they are measured against
    a fraction of the tree's largest gradient instead of against themselves.
    """
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    leaves = jax.tree.leaves(expected)
    tree_max = max(float(jnp.max(jnp.abs(leaf))) for leaf in leaves)
    assert tree_max > 0, "all values are zero: the comparison would be vacuous"
    paths = jax.tree_util.tree_flatten_with_path(expected)[0]
    for (path, b), a in zip(paths, jax.tree.leaves(actual), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype, jax.tree_util.keystr(path)
        scale = max(float(np.max(np.abs(b))), floor * tree_max)
        np.testing.assert_allclose(
            a, b, rtol=rtol, atol=rtol * scale, err_msg=jax.tree_util.keystr(path)
        )


def compiled(fn, *args):
    """Lowers and compiles ``jax.jit(fn)`` for ``args``."""
    return jax.jit(fn).lower(*args).compile()


def temp_bytes(fn, *args) -> int:
    """XLA's planned temporary (activation/workspace) memory of ``jit(fn)``."""
    return compiled(fn, *args).memory_analysis().temp_size_in_bytes


def flops(fn, *args) -> float:
    """XLA's FLOP count of ``jit(fn)`` (a loop body is counted once)."""
    return compiled(fn, *args).cost_analysis()["flops"]
