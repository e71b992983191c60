"""``python -m experiments.numerics``: runs :mod:`benchmarks.numerics`."""

from benchmarks.numerics import main

if __name__ == "__main__":
    main()
