"""``python -m experiments.numerics``: runs :mod:`benchmarks.numerics`."""

from experiments import run_benchmark

run_benchmark(__name__, "numerics")
