"""Shared test configuration: hypothesis profiles and float64 helpers."""

import os

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
# (about a third less time). HLO passes still run, so compiled memory and FLOP
# counts are the same; `make test-next` runs the core suites with them on, and
# JAX_DISABLE_MOST_OPTIMIZATIONS=0 turns them on here. Set before JAX is
# imported, so that the suite's subprocesses inherit it.
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
