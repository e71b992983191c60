"""``python -m experiments.overhead``: runs :mod:`benchmarks.overhead`."""

from benchmarks.overhead import main

if __name__ == "__main__":
    main()
