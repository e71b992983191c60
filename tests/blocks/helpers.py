"""Shared helpers for the block tests: those of ``tests.helpers``, re-exported."""

from __future__ import annotations

from tests.helpers import (  # noqa: F401 - shared with the core tests
    assert_trees_close,
    compiled,
    flop_count,
    flops,
    temp_bytes,
    temp_size,
)
