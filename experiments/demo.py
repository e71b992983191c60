"""``python -m experiments.demo``: runs the demo, :mod:`benchmarks.demo`
(``make demo``)."""

from experiments import run_benchmark

run_benchmark(__name__, "demo")
