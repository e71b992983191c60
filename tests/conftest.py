"""Shared test configuration: hypothesis profiles and float64 helpers."""

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=25,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "long",
    deadline=None,
    max_examples=500,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("REVNET_HYPOTHESIS_PROFILE", "ci"))

# XLA compiles the suite's many small programs without its LLVM optimisations
# (about a quarter less CPU time). HLO passes still run, so compiled memory and
# FLOP counts are the same. Tests marked `optimized` compile with them (their
# results depend on XLA's code generation), `make test-next` runs the core
# suites with them, and JAX_DISABLE_MOST_OPTIMIZATIONS=0 turns them on for all.
# Set before JAX is imported, so that the suite's subprocesses inherit it.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

# Run-time reconstruction checks (revnet/_engine/runtime_checks.py) are on for the
# whole suite.
os.environ.setdefault("REVNET_RUNTIME_CHECKS", "1")

# Under JAX_CUSTOM_VJP3/JAX_REMAT3/JAX_SCAN3 (make test-next), a test whose plain
# JAX reference fails inside JAX is skipped with JAX's message (tests/next_flags.py).
from tests.next_flags import (  # noqa: E402, F401
    pytest_configure,
    pytest_runtest_makereport,
    pytest_runtest_setup,
)


@pytest.fixture(autouse=True)
def _optimized(request):
    """XLA's full optimisations for a test marked ``optimized``."""
    if request.node.get_closest_marker("optimized") is None:
        yield
        return
    import jax

    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


# XLA:CPU maps memory for every program it compiles (about three mappings each)
# and JAX keeps every compiled program alive in its caches. A pytest worker that
# compiles tens of thousands of programs reaches the kernel's vm.max_map_count
# (65,530 by default), and XLA then segfaults inside a compilation (seen twice
# in CI, each time in a different test). After a test module, once the worker
# holds more than a third of the limit, JAX's caches are cleared; the next
# module compiles what it needs again.
def mappings() -> int | None:
    """This process's memory mappings, or None where /proc does not say."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def _mapping_budget() -> int | None:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read()) // 3
    except (OSError, ValueError):
        return None


def release_compiled_programs() -> None:
    """Drops JAX's caches, so that XLA unmaps the programs they held."""
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


_BUDGET = _mapping_budget()


def pytest_runtest_teardown(item, nextitem):
    if _BUDGET is None or (nextitem is not None and nextitem.module is item.module):
        return
    held = mappings()
    if held is not None and held > _BUDGET:
        release_compiled_programs()
