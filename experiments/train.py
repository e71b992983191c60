"""Trains a small RevNet on scikit-learn's digits: runs ``examples/digits.py``.

``python -m experiments.train [flags]`` passes its flags to the example, with
``--tiny`` and ``--quick`` (the other experiments' size flags) read as
``--smoke``; ``python -m experiments.train --help`` lists the example's flags.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

EXAMPLE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "digits.py"
)


def main(argv: Sequence[str] | None = None) -> dict:
    """Runs the digits example with ``argv`` (default: the command line)."""
    args = list(sys.argv[1:] if argv is None else argv)
    args = ["--smoke" if a in ("--tiny", "--quick") else a for a in args]
    return runpy.run_path(EXAMPLE, run_name="digits")["main"](args)


if __name__ == "__main__":
    main()
