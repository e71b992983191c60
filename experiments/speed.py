"""Step time of revnet against the plain Haiku a user would otherwise write.

For each model (the peers' conv stack, the RevNet, the MLP coupling stack and
the transformer) and depth, one training gradient step (``jit(grad)``) is
timed for each method on the same parameters: ``plain`` (the block functions
in a Python loop: plain Haiku, unrolled, ordinary backprop), ``layer_stack``
(``hk.layer_stack``), ``reversible`` (``ReversibleSequence``), and optionally
``standard`` (its ``reversible=False`` twin) and ``checkpoint`` (per-block
``hk.remat``). Every measurement is a fresh process
(``experiments.step_worker``) that compiles, warms up and times a few steps
and reports their median; the processes of all methods are interleaved in
rounds with a rotating order, and each figure is the median over rounds.
Ratios are to the *best plain* baseline, the faster of ``plain`` and
``layer_stack`` at that depth. Compiled temp memory and FLOPs come from the
same compiled steps (FLOPs count a loop body once, see ``experiments.memory``
for per-block FLOP ratios).

Run ``python -m experiments.speed --help`` for the flags.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from experiments import common

NAME = "speed"
DESCRIPTION = __doc__.split("\n\n")[0]
METHODS = ("plain", "layer_stack", "standard", "checkpoint", "reversible")
DEFAULT_METHODS = ("plain", "layer_stack", "reversible")
MODELS = ("conv", "revnet", "mlp", "transformer")
# Depth is the number of coupling blocks; the RevNet's units are spread over
# its three stages (depth 16 -> 5 units per stage, 15 in all).
DEPTHS = {"full": [4, 16, 64], "quick": [4, 16], "tiny": [2]}
ROUNDS = {"full": 5, "quick": 3, "tiny": 1}
STEPS = {"full": 5, "quick": 3, "tiny": 1}
LIMIT = 1.35  # the step-time budget against the best plain baseline


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = common.make_parser("python -m experiments.speed", DESCRIPTION)
    common.add_choices_flag(parser, "models", MODELS, MODELS)
    common.add_choices_flag(parser, "methods", METHODS, DEFAULT_METHODS)
    parser.add_argument(
        "--depths",
        type=common.int_list,
        default=None,
        help="comma-separated depths in coupling blocks (default: 4,16,64; "
        "4,16 with --quick)",
    )
    parser.add_argument(
        "--rounds",
        type=common.positive_int,
        default=None,
        help="interleaved rounds of fresh processes (default: 5; 3 with --quick)",
    )
    parser.add_argument(
        "--steps",
        type=common.positive_int,
        default=None,
        help="timed steps per process (default: 5; 3 with --quick)",
    )
    return parser


def spec_for(model: str, method: str, depth: int, tiny: bool) -> dict[str, Any]:
    """The configuration of one measurement (see ``experiments.models``)."""
    from experiments import models

    sizes = models.default_sizes(model, quick=True)
    if tiny:
        sizes = {**sizes, **_TINY.get(model, {})}
    units = max(1, depth // 3) if model == "revnet" else depth
    return {"model": model, "method": method, "depth": units, **sizes}


_TINY = {
    "mlp": {"width": 32, "batch": 16},
    "conv": {"image_size": 8, "batch": 2, "channels": 8},
    "revnet": {"image_size": 8, "batch": 2},
    "transformer": {"seq_len": 8, "batch": 2},
}


def run_worker(spec: dict[str, Any], cache: str) -> dict[str, Any]:
    """Times ``spec`` in a fresh process; returns the worker's JSON or an error."""
    env = {
        **os.environ,
        "REVNET_RUNTIME_CHECKS": "0",  # measure the library's default
        # Compiled programs are reused across rounds; only timing is repeated.
        "JAX_COMPILATION_CACHE_DIR": cache,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
    }
    cmd = [sys.executable, "-m", "experiments.step_worker", json.dumps(spec)]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {proc.returncode}: {tail}"}
    return json.loads(lines[-1])


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Runs every (model, depth) in interleaved rounds; returns one row each."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="revnet-speed-") as cache:
        for model in args.models:
            for depth in args.depths:
                rows.append(_measure_one(model, depth, args, cache))
    return rows


def _measure_one(model, depth, args, cache) -> dict[str, Any]:
    methods = list(args.methods)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    for r in range(args.rounds):
        order = methods[r % len(methods) :] + methods[: r % len(methods)]
        for method in order:
            spec = spec_for(model, method, depth, args.tiny)
            res = run_worker({**spec, "time_steps": args.steps}, cache)
            runs[method].append(res)
            shown = res.get("error") or f"{1e3 * res['median_s']:.1f} ms"
            print(
                f"[speed] {model:11s} depth {depth:3d} round {r} {method:11s} {shown}",
                flush=True,
            )
    row: dict[str, Any] = {"model": model, "depth": depth, "methods": {}}
    for method, results in runs.items():
        good = [res for res in results if "error" not in res]
        if not good:
            row["methods"][method] = {"error": results[-1]["error"]}
            continue
        medians = [res["median_s"] for res in good]
        row["methods"][method] = {
            "median_s": statistics.median(medians),
            "process_medians_s": medians,
            "temp_bytes": good[0]["temp_bytes"],
            "flops": good[0]["flops"],
        }
    from experiments.baselines import compare_to_best_plain

    best = compare_to_best_plain(row["methods"])
    if best is not None:
        row["best_plain"] = best
    return row


def markdown(rows: list[dict[str, Any]], machine: dict[str, Any]) -> str:
    """The results as a markdown table."""
    lines = [
        "## Step time against plain Haiku",
        "",
        f"Platform: {machine['backend']} ({machine['processor']}, "
        f"{machine['cpu_count']} cores), jax {machine['jax']}. One training "
        "gradient step per measurement, median over interleaved fresh processes; "
        "ratios to the best plain baseline (the faster of the unrolled plain-Haiku "
        "loop and `hk.layer_stack`).",
        "",
        "| model | depth | method | step ms | x best plain | temp MiB "
        "| temp / best plain |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for method, s in row["methods"].items():
            if "error" in s:
                lines.append(
                    f"| {row['model']} | {row['depth']} | {method} | error: "
                    f"{s['error']} | | | |"
                )
                continue
            mark = " (best plain)" if method == row.get("best_plain") else ""
            lines.append(
                f"| {row['model']} | {row['depth']} | {method}{mark} "
                f"| {1e3 * s['median_s']:.1f} | {s.get('time_vs_best_plain', 0):.2f} "
                f"| {s['temp_bytes'] / common.MIB:.2f} "
                f"| {s.get('temp_vs_best_plain', 0):.3f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parses flags, measures, writes JSON and markdown."""
    parser = build_parser()
    args = common.parse_args(parser, argv)
    size = "tiny" if args.tiny else "quick" if args.quick else "full"
    args.depths = args.depths or DEPTHS[size]
    args.rounds = args.rounds or ROUNDS[size]
    args.steps = args.steps or STEPS[size]
    rows = measure(args)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    config["runtime_checks"] = False
    path = common.write_json(args.out, NAME, config, {"rows": rows, "limit": LIMIT})
    text = markdown(rows, common.machine_info())
    common.atomic_write_bytes(os.path.join(args.out, f"{NAME}.md"), text.encode())
    print(text)
    print(f"[speed] wrote {path}")
    failed = [
        (r["model"], r["depth"], m)
        for r in rows
        for m, s in r["methods"].items()
        if "error" in s
    ]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
