"""``python -m experiments.loop_compare``: runs :mod:`benchmarks.loops`.

The loop comparison is part of the loops benchmark.
"""

from benchmarks.loops import main

if __name__ == "__main__":
    main()
