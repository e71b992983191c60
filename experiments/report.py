"""``python -m experiments.report``: rebuilds ``REPORT.md`` from stored JSON."""

import sys

from benchmarks.run import main

if __name__ == "__main__":
    sys.exit(main(["--report-only", *sys.argv[1:]]))
