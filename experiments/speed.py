"""``python -m experiments.speed``: runs :mod:`benchmarks.speed`."""

from experiments import run_benchmark

run_benchmark(__name__, "speed")
