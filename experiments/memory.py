"""``python -m experiments.memory``: runs :mod:`benchmarks.memory`."""

from experiments import run_benchmark

run_benchmark(__name__, "memory")
