"""Shared helpers for the block tests: tree comparison and compiled metrics."""

from __future__ import annotations

import jax

from tests.helpers import assert_trees_close  # noqa: F401 - shared with the core


def compiled(fn, *args):
    """Lowers and compiles ``jax.jit(fn)`` for ``args``."""
    return jax.jit(fn).lower(*args).compile()


def temp_bytes(fn, *args) -> int:
    """XLA's planned temporary (activation/workspace) memory of ``jit(fn)``."""
    return compiled(fn, *args).memory_analysis().temp_size_in_bytes


def flops(fn, *args) -> float:
    """XLA's FLOP count of ``jit(fn)`` (a loop body is counted once)."""
    return compiled(fn, *args).cost_analysis()["flops"]
