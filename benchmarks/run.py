"""Runs the benchmarks, each in its own process, then writes ``REPORT.md``.

    python -m benchmarks.run [--quick | --tiny] [--out results] [--only a,b]
        [--report-only]

Each benchmark in :data:`benchmarks.BENCHMARKS` (or ``--only``'s) runs as
``python -m benchmarks.<module>``; one that fails is reported and the others
still run, and the exit status is non-zero if any failed. The report is built
from the JSON files in ``--out`` by each module's ``markdown``;
``--report-only`` rebuilds it from them without running anything.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence

from benchmarks import BENCHMARKS, measure

HERE = os.path.dirname(os.path.abspath(__file__))


def _names(text: str) -> list[str]:
    """The benchmarks named in ``a,b``; an unknown one is a bad flag."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {unknown}; see {list(BENCHMARKS)}")
    return names


def _flags(parser) -> None:
    only = ",".join(BENCHMARKS)
    parser.add_argument("--only", type=_names, default=only, help="names, a,b")
    parser.add_argument("--report-only", action="store_true", help="no runs")


def section(name: str, out: str) -> str:
    """The benchmark's report section, from ``<out>/<name>.json``."""
    path = os.path.join(out, f"{name}.json")
    if not os.path.exists(path):
        return f"## {name}\n\nNo `{name}.json` in this folder."
    try:
        module = importlib.import_module(f"benchmarks.{BENCHMARKS[name]}")
        with open(path) as f:
            return module.markdown(json.load(f), out)
    except Exception as err:  # a broken section must not lose the others
        return f"## {name}\n\nCould not render `{name}.json`: {err!r}"


def write_report(out: str, names: Sequence[str], runs: Sequence[list]) -> str:
    """Writes ``<out>/REPORT.md`` for ``names``; returns its path."""
    head = [
        "# revnet: benchmark report",
        "Figures are from one run; times on shared machines move by ±50%, "
        "compiled memory and FLOPs are deterministic.",
    ]
    if runs:
        head.append(measure.table(["benchmark", "exit code", "seconds"], runs))
    text = "\n\n".join(head + [section(n, out) for n in names]) + "\n"
    path = os.path.join(out, "REPORT.md")
    measure.atomic_write(path, text.encode())
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the chosen benchmarks, then writes the report; 1 if any failed."""
    args = measure.parse(__doc__, argv, _flags)
    names = args.only
    size = ["--tiny"] if args.tiny else ["--quick"] if args.quick else []
    runs = []
    out = os.path.abspath(args.out)
    for name in [] if args.report_only else names:
        if not os.path.exists(os.path.join(HERE, f"{BENCHMARKS[name]}.py")):
            print(f"[run] skipping {name}: no benchmarks/{BENCHMARKS[name]}.py")
            continue
        cmd = [sys.executable, "-m", f"benchmarks.{BENCHMARKS[name]}", *size]
        print(f"[run] {' '.join(cmd[1:])} --out {args.out}", flush=True)
        start = time.perf_counter()
        code = subprocess.call([*cmd, "--out", out], cwd=measure.ROOT)
        runs.append([name, code, round(time.perf_counter() - start, 1)])
        print(f"[run] {name}: exit {code} after {runs[-1][2]} s", flush=True)
    path = write_report(args.out, names, runs)
    print(f"[run] wrote {path}")
    return 1 if any(code for _, code, _ in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
