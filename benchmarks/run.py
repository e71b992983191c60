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
from typing import Any

from benchmarks import BENCHMARKS, measure

HERE = os.path.dirname(os.path.abspath(__file__))


def _names(text: str) -> list[str]:
    """The benchmarks named in ``a,b``; an unknown one is a bad flag."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {unknown}; see {list(BENCHMARKS)}")
    return names


def progress(items: Sequence[Any], desc: str, unit: str = "part") -> Any:
    """``items`` under a tqdm progress bar (on stderr), or bare without tqdm."""
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm comes with the experiments extra
        return items
    if not items:
        return items
    return tqdm(items, desc=desc, unit=unit, file=sys.stderr)


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


SIZE_NOTES = {
    "tiny": "**Tiny run (`--tiny`): every benchmark at its smallest sizes, only "
    "to show that it runs. Nothing here is a result: timings are one or a few "
    "samples of toy-sized steps (single-timing ratios are left out), and the "
    "trainings are smoke runs. `make demo` and `make demo-full` give the "
    "figures.**",
    "quick": "Sizes: `--quick` (`make demo-full`), each benchmark's smaller "
    "configuration; each section states its sizes.",
    "full": "Sizes: full; each section states its sizes.",
}


def run_size(out: str, names: Sequence[str]) -> str | None:
    """``"tiny"``, ``"quick"`` or ``"full"`` as the stored JSON files say."""
    sizes = set()
    for name in names:
        try:
            with open(os.path.join(out, f"{name}.json")) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("size"), str):
            sizes.add(data["size"])
    if "tiny" in sizes:
        return "tiny"
    return sizes.pop() if len(sizes) == 1 else None


def write_report(
    out: str, names: Sequence[str], runs: Sequence[list], size: str | None = None
) -> str:
    """Writes ``<out>/REPORT.md`` for ``names``; returns its path.

    ``size`` (``"tiny"``, ``"quick"``, ``"full"``; None: read from the JSON
    files) is stated at the top; a tiny report says that it holds no result.
    """
    size = size or run_size(out, names)
    head = ["# revnet: benchmark report"]
    if size in SIZE_NOTES:
        head.append(SIZE_NOTES[size])
    head.append(
        "Figures are from one run; times on shared machines move by ±50%, "
        "compiled memory and FLOPs are deterministic."
    )
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
    todo = [] if args.report_only else names
    for name in progress(todo, "benchmarks", "benchmark"):
        if not os.path.exists(os.path.join(HERE, f"{BENCHMARKS[name]}.py")):
            print(f"[run] skipping {name}: no benchmarks/{BENCHMARKS[name]}.py")
            continue
        cmd = [sys.executable, "-m", f"benchmarks.{BENCHMARKS[name]}", *size]
        print(f"[run] {' '.join(cmd[1:])} --out {args.out}", flush=True)
        start = time.perf_counter()
        code = subprocess.call([*cmd, "--out", out], cwd=measure.ROOT)
        runs.append([name, code, round(time.perf_counter() - start, 1)])
        print(f"[run] {name}: exit {code} after {runs[-1][2]} s", flush=True)
    path = write_report(args.out, names, runs, None if args.report_only else args.size)
    print(f"[run] wrote {path}")
    return 1 if any(code for _, code, _ in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
