"""Trains a small RevNet on scikit-learn's digits: runs ``examples/digits.py``.

``python -m experiments.train [flags]`` runs the example as a script with its
flags, with ``--tiny`` and ``--quick`` (the other experiments' size flags) read
as ``--smoke``; ``python -m experiments.train --help`` lists the example's
flags. A bad flag ends it at once with one line and exit status 2, before JAX
is imported; a failure while saving ends it with one line and exit status 1.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

EXAMPLE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "digits.py"
)


def main(argv: Sequence[str] | None = None) -> None:
    """Runs the digits example as ``__main__`` with ``argv`` (default: the
    command line); it ends the process with ``SystemExit`` on an error."""
    args = list(sys.argv[1:] if argv is None else argv)
    args = ["--smoke" if a in ("--tiny", "--quick") else a for a in args]
    saved = sys.argv
    sys.argv = [sys.argv[0], *args]  # the example parses these, as a script does
    try:
        runpy.run_path(EXAMPLE, run_name="__main__")
    finally:
        sys.argv = saved


if __name__ == "__main__":
    main()
