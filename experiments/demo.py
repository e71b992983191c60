"""Runs every experiment, each in its own process, then writes ``REPORT.md``.

``make demo`` runs ``python -m experiments.demo --quick --out results``: the
memory sweep, the step-time comparison with plain Haiku, the digits training,
the numerics sweep, the loops experiment and the call-overhead benchmark,
then ``results/REPORT.md`` with their tables and plots. A script that fails
is reported and the others still run; the exit status is non-zero if any
failed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence

from experiments import common

SCRIPTS = ("memory", "speed", "train", "numerics", "loops", "overhead")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    parser = common.make_parser("python -m experiments.demo", __doc__.split("\n\n")[0])
    parser.add_argument(
        "--only",
        type=common.choice_list(SCRIPTS),
        default=list(SCRIPTS),
        help=f"comma-separated scripts to run (default: {','.join(SCRIPTS)})",
    )
    args = common.parse_args(parser, argv)
    from experiments import report

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    flags = (
        ["--out", args.out]
        + (["--tiny"] if args.tiny else [])
        + (["--quick"] if args.quick else [])
    )
    runs = []
    for name in args.only:
        if not os.path.exists(os.path.join(here, f"{name}.py")):
            print(f"[demo] skipping {name}: experiments/{name}.py does not exist")
            continue
        cmd = [sys.executable, "-m", f"experiments.{name}", *flags]
        print(f"[demo] {' '.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        code = subprocess.call(cmd, cwd=root)
        seconds = time.perf_counter() - start
        runs.append({"name": name, "returncode": code, "seconds": round(seconds, 1)})
        print(f"[demo] {name}: exit {code} after {seconds:.0f} s", flush=True)
    path = report.write_report(args.out, runs)
    total = sum(r["seconds"] for r in runs)
    print(f"[demo] wrote {path} ({total:.0f} s in all)")
    return 0 if all(r["returncode"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
