"""``python -m experiments.speed``: runs :mod:`benchmarks.speed`."""

from benchmarks.speed import main

if __name__ == "__main__":
    main()
