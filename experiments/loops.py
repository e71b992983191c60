"""``python -m experiments.loops``: runs :mod:`benchmarks.loops`."""

from benchmarks.loops import main

if __name__ == "__main__":
    main()
