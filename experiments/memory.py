"""``python -m experiments.memory``: runs :mod:`benchmarks.memory`."""

from benchmarks.memory import main

if __name__ == "__main__":
    main()
