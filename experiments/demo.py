"""``python -m experiments.demo``: runs :mod:`benchmarks.run` (every benchmark)."""

import sys

from benchmarks.run import main

if __name__ == "__main__":
    sys.exit(main())
