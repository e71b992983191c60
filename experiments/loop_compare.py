"""``python -m experiments.loop_compare``: runs :mod:`benchmarks.loops`, of
which the loop comparison is part."""

from experiments import run_benchmark

run_benchmark(__name__, "loops")
