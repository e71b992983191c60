"""``python -m experiments.overhead``: runs :mod:`benchmarks.overhead`."""

from experiments import run_benchmark

run_benchmark(__name__, "overhead")
