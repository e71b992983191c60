"""Benchmarks: each module has ``NAME``, ``main(argv)`` and ``markdown(results)``."""
