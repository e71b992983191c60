"""``python -m experiments.loops``: runs :mod:`benchmarks.loops`."""

from experiments import run_benchmark

run_benchmark(__name__, "loops")
