"""``python -m experiments.demo``: the demo, :mod:`benchmarks.demo` (``make demo``)."""

from benchmarks.demo import main

if __name__ == "__main__":
    main()
