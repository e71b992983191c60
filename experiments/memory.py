"""Memory, FLOPs and time of training the same parameters every way, vs depth.

For each model (an MLP coupling stack, the peers' conv stack, the CIFAR-shaped
``RevNet``, the ``ReversibleTransformer``) and each depth, the same parameters
are trained as plain Haiku (an unrolled Python loop of the blocks, and
``hk.layer_stack``), with standard backprop on the ``reversible=False`` twin,
with per-block checkpointing and with the reversible backward pass (and, for
the MLP, the same stack written as a plain function under
``@revnet.invertible``). Ratios are given to the twin and to the *best plain*
baseline, the faster of the two plain-Haiku layouts. Reported per
configuration: compiled activation memory
(``memory_analysis().temp_size_in_bytes``), FLOPs (``cost_analysis``; a scan
body is counted once, so these are per-block figures for scanned stacks and
the MLP is also measured unrolled), median step time over alternating runs,
peak RSS of a real training step in its own process, and the largest depth and
batch each method fits into ``--budget-mib``.

Run ``python -m experiments.memory --help`` for the flags.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
from typing import Any

from experiments import common

DESCRIPTION = __doc__.split("\n\n")[0]
# Quick mode fits `make demo` into ~5 minutes on 2 loaded cores: a RevNet
# training-step compile takes 5-9 s there, so the RevNet gets two depths.
DEPTHS_QUICK = {
    "mlp": [2, 8, 32],
    "conv": [2, 8],
    "revnet": [1, 3],
    "transformer": [2, 8, 32],
}
DEPTHS_FULL = {
    "mlp": [2, 4, 8, 16, 32, 64, 128],
    "conv": [2, 4, 8, 16, 32, 64],
    "revnet": [1, 2, 4, 9, 18],
    "transformer": [2, 4, 8, 16, 32, 64],
}
DEPTHS_TINY = {
    "mlp": [2, 8, 32],
    "conv": [2],
    "revnet": [1, 2],
    "transformer": [2, 8],
}
# What --quick measures beyond the sweep, per model (compiling a RevNet takes
# several seconds, so its budget search and RSS runs are left to full runs).
QUICK_EXTRAS = {
    "mlp": {"budget": "both", "rss": True},
    "conv": {"budget": "none", "rss": False},
    "transformer": {"budget": "none", "rss": False},
    "revnet": {"budget": "none", "rss": False},
}


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    from experiments.models import METHODS, MODELS

    parser = common.make_parser("python -m experiments.memory", DESCRIPTION)
    common.add_choices_flag(parser, "models", MODELS, MODELS)
    common.add_choices_flag(parser, "methods", METHODS, METHODS)
    parser.add_argument(
        "--depths",
        type=common.int_list,
        default=None,
        help="comma-separated depths for every model (default: per model, "
        "e.g. 2,4,8,16,32 for the MLP in --quick mode)",
    )
    parser.add_argument(
        "--batch", type=common.positive_int, default=None, help="override the batch"
    )
    parser.add_argument(
        "--budget-mib",
        type=common.positive_float,
        default=None,
        help="memory budget for the largest depth/batch that fits "
        "(default: 64 in --quick mode, 1024 otherwise)",
    )
    parser.add_argument(
        "--repeats",
        type=common.positive_int,
        default=None,
        help="timed rounds per configuration (default: 5 quick, 15 otherwise)",
    )
    parser.add_argument(
        "--rss",
        choices=("none", "largest", "all"),
        default=None,
        help="depths at which to measure peak RSS in subprocesses "
        "(default: largest; in --quick mode for the MLP only; none with --tiny)",
    )
    parser.add_argument(
        "--budget-search",
        choices=("auto", "none", "depth", "both"),
        default="auto",
        help="search the largest depth and/or batch under --budget-mib "
        "(auto: both; in --quick mode depth+batch for the MLP only; depth "
        "only with --tiny)",
    )
    return parser


def _fit_guess(depths: list[int], totals: list[float], budget: float) -> int:
    """Linear extrapolation of the largest ``n`` with ``total(n) <= budget``."""
    if len(depths) < 2:
        return depths[-1]
    slope = (totals[-1] - totals[-2]) / (depths[-1] - depths[-2])
    if slope <= 0:
        return depths[-1] * 64
    return max(1, int(depths[-1] + (budget - totals[-1]) / slope))


def _budget_fit(
    spec: dict[str, Any], key: str, guess: int, cap: int, budget: float
) -> dict[str, Any]:
    from experiments import models

    def measure(n: int) -> float:
        built = models.build({**spec, key: n}, abstract=True)
        return common.compile_stats(built.grad_step, *built.args)[1]["total_bytes"]

    best, calls = common.largest_fitting(measure, budget, guess, cap)
    return {"largest": best, "cap": cap, "at_cap": best == cap, "compiles": calls}


def sweep_model(
    model: str, depths: list[int], args: argparse.Namespace
) -> dict[str, Any]:
    """Measures one model over depths and methods; see the module docstring."""
    from experiments import models

    sizes = models.default_sizes(model, args.quick)
    if args.tiny and model == "mlp":
        sizes = {"width": 64, "batch": 128}
    if args.batch:
        sizes["batch"] = args.batch
    methods = [m for m in args.methods if m != "generic" or model == "mlp"]
    result: dict[str, Any] = {"sizes": sizes, "depths": depths, "methods": methods}
    rows: list[dict[str, Any]] = []
    missing: dict[str, str] = {}
    for depth in depths:
        compiled: dict[str, Any] = {}
        init = None  # one init per depth: every method trains the same parameters
        for method in methods:
            spec = {"model": model, "method": method, "depth": depth, **sizes}
            try:
                built = models.build(spec, init=init)
                init = built.init
                exe, stats = common.compile_stats(built.grad_step, *built.args)
            except models.Unavailable as err:
                missing[method] = str(err)
                continue
            compiled[method] = (exe, built.args)
            row = {"depth": depth, "method": method, "num_params": built.num_params}
            row.update(stats)
            if built.remat_calls is not None:
                row["remat_calls_at_trace"] = built.remat_calls[0]
            rows.append(row)
            print(
                f"[memory] {model:11s} depth {depth:4d} {method:10s} "
                f"temp {stats['temp_bytes'] / common.MIB:9.2f} MiB  "
                f"flops {stats['flops']:.3e}",
                flush=True,
            )
        if compiled:
            times = common.median_times(
                {m: (lambda e=e, a=a: e(*a)) for m, (e, a) in compiled.items()},
                repeats=args.repeats,
            )
            for row in rows:
                if row["depth"] == depth and row["method"] in times:
                    row.update(times[row["method"]])
    result["missing"] = missing
    result["rows"] = rows
    if not rows:
        return result
    _add_ratios(rows)
    search = args.budget_search
    if search == "auto":
        search = "depth" if args.tiny else "both"
        if args.quick and not args.tiny:
            search = QUICK_EXTRAS[model]["budget"]
    if search != "none":
        result["budget"] = _budgets(model, sizes, depths, rows, args, search)
    if model == "mlp" and not args.tiny:
        result["unrolled_flops"] = _unrolled_flops(sizes, args.methods)
    result["rss"] = _rss(model, sizes, depths, methods, missing, args)
    return result


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    """Ratios to the standard twin, and to the best plain baseline.

    The best plain baseline at a depth is the faster (median step time) of
    ``plain`` (an unrolled plain-Haiku loop) and ``layer_stack``.
    """
    from experiments.baselines import compare_to_best_plain

    for depth in {r["depth"] for r in rows}:
        at_depth = {r["method"]: r for r in rows if r["depth"] == depth}
        best = compare_to_best_plain(at_depth)
        if best is not None:
            for row in at_depth.values():
                if "median_s" in row:
                    row["best_plain"] = best
    base = {r["depth"]: r for r in rows if r["method"] == "standard"}
    for row in rows:
        ref = base.get(row["depth"])
        if ref is None:
            continue
        row["temp_ratio"] = row["temp_bytes"] / max(ref["temp_bytes"], 1.0)
        row["flops_ratio"] = row["flops"] / ref["flops"]
        if "median_s" in row and "median_s" in ref:
            row["time_ratio"] = row["median_s"] / ref["median_s"]
            row["time_ratio_min"] = row["min_s"] / ref["min_s"]
            row["time_ratio_max"] = row["max_s"] / ref["max_s"]


def _budgets(
    model: str,
    sizes: dict[str, Any],
    depths: list[int],
    rows: list[dict[str, Any]],
    args: argparse.Namespace,
    search: str,
) -> dict[str, Any]:
    from experiments.baselines import PLAIN_METHODS

    budget = args.budget_mib * common.MIB
    out: dict[str, Any] = {"budget_mib": args.budget_mib, "methods": {}}
    depth_cap = 4096 if model == "mlp" else 256
    # Compiling ever deeper unrolled plain stacks costs minutes: the plain
    # baselines' memory is read off the sweep instead.
    for method in {r["method"] for r in rows} - set(PLAIN_METHODS):
        mine = sorted(
            (r for r in rows if r["method"] == method), key=lambda r: r["depth"]
        )
        spec = {"model": model, "method": method, **sizes, "depth": depths[-1]}
        guess = _fit_guess(
            [r["depth"] for r in mine], [r["total_bytes"] for r in mine], budget
        )
        by_depth = _budget_fit(spec, "depth", guess, depth_cap, budget)
        out["methods"][method] = {"largest_depth": by_depth}
        if search == "both":
            per_example = mine[-1]["total_bytes"] / sizes["batch"]
            batch_guess = max(1, int(budget / per_example))
            by_batch = _budget_fit(spec, "batch", batch_guess, 1 << 16, budget)
            out["methods"][method]["largest_batch_at_depth"] = {
                **by_batch,
                "depth": depths[-1],
            }
        print(
            f"[memory] {model:11s} {method:10s} fits {args.budget_mib:g} MiB: "
            f"{out['methods'][method]}",
            flush=True,
        )
    return out


def _unrolled_flops(sizes: dict[str, Any], methods: list[str]) -> dict[str, Any]:
    """FLOPs of the MLP written as an unrolled chain (no scan), depths 2 and 4.

    The difference between the two depths is the true cost of two blocks, free
    of XLA counting a scan body once.
    """
    from experiments import models
    from experiments.baselines import PLAIN_METHODS

    out: dict[str, Any] = {"depths": [2, 4], "per_block_flops": {}}
    for method in methods:
        if method == "generic" or method in PLAIN_METHODS:
            continue
        flops = []
        for depth in (2, 4):
            spec = {"model": "mlp", "method": method, "depth": depth, **sizes}
            built = models.build({**spec, "unrolled": True})
            flops.append(common.compile_stats(built.grad_step, *built.args)[1]["flops"])
        out["per_block_flops"][method] = (flops[1] - flops[0]) / 2
    base = out["per_block_flops"].get("standard")
    if base:
        out["per_block_ratio"] = {
            m: f / base for m, f in out["per_block_flops"].items()
        }
    return out


def _rss(
    model: str,
    sizes: dict[str, Any],
    depths: list[int],
    methods: list[str],
    missing: dict[str, str],
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    rss = args.rss
    if rss is None:
        rss = "largest" if not args.quick or QUICK_EXTRAS[model]["rss"] else "none"
    if rss == "none":
        return []
    chosen = depths if rss == "all" else [depths[-1]]
    jobs = [
        {"model": model, "method": method, "depth": depth, **sizes}
        for depth in chosen
        for method in methods
        if method not in missing
    ]
    # Two processes at a time: each reads its own high-water mark, so running
    # side by side does not change what either measures.
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(common.peak_rss_subprocess, jobs))
    out = []
    for spec, res in zip(jobs, results, strict=True):
        out.append({"depth": spec["depth"], "method": spec["method"], **res})
        print(f"[memory] {model:11s} {out[-1]}", flush=True)
    return out


def plot(results: dict[str, Any], out: str) -> str:
    """Writes ``<out>/memory.png``: memory, FLOP ratio and time ratio vs depth."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [m for m, r in results["models"].items() if r.get("rows")]
    fig, axes = plt.subplots(
        max(1, len(names)), 3, figsize=(15, 4 * max(1, len(names))), squeeze=False
    )
    styles = {
        "standard": ("tab:red", "o"),
        "checkpoint": ("tab:orange", "s"),
        "reversible": ("tab:green", "^"),
        "generic": ("tab:blue", "x"),
        "plain": ("tab:purple", "D"),
        "layer_stack": ("tab:brown", "v"),
    }
    for ax_row, name in zip(axes, names, strict=False):
        rows = results["models"][name]["rows"]
        for method in results["models"][name]["methods"]:
            mine = sorted(
                (r for r in rows if r["method"] == method), key=lambda r: r["depth"]
            )
            if not mine:
                continue
            color, marker = styles[method]
            d = [r["depth"] for r in mine]
            kw = {"color": color, "marker": marker, "label": method}
            ax_row[0].plot(d, [r["temp_bytes"] / common.MIB for r in mine], **kw)
            ax_row[1].plot(d, [r.get("flops_ratio", float("nan")) for r in mine], **kw)
            if all("time_ratio" in r for r in mine):
                med = [r["time_ratio"] for r in mine]
                lo = [r["time_ratio_min"] for r in mine]
                hi = [r["time_ratio_max"] for r in mine]
                ax_row[2].errorbar(
                    d,
                    med,
                    yerr=[
                        [max(m - a, 0) for m, a in zip(med, lo, strict=True)],
                        [max(b - m, 0) for m, b in zip(med, hi, strict=True)],
                    ],
                    capsize=3,
                    **kw,
                )
        unit = "units per stage" if name == "revnet" else "blocks"
        ax_row[0].set(
            title=f"{name}: compiled activation memory",
            xlabel=f"depth ({unit})",
            ylabel="temp_size_in_bytes (MiB)",
            yscale="log",
        )
        ax_row[1].set(
            title=f"{name}: FLOPs / standard (scan body counted once)",
            xlabel=f"depth ({unit})",
            ylabel="ratio",
        )
        ax_row[1].axhline(4 / 3, color="gray", ls="--", lw=1, label="4/3")
        ax_row[2].set(
            title=f"{name}: step time / standard (median, min-max)",
            xlabel=f"depth ({unit})",
            ylabel="ratio",
        )
        for ax in ax_row:
            ax.set_xscale("log", base=2)
            ax.set_xticks(results["models"][name]["depths"])
            ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"{results['device']}: training the same parameters three ways")
    fig.tight_layout()
    return common.save_figure(fig, out, "memory")


def main(argv: list[str] | None = None) -> int:
    """Entry point: parses flags, runs the sweep, writes JSON and plot."""
    parser = build_parser()
    args = common.parse_args(parser, argv)
    if args.budget_mib is None:
        args.budget_mib = 64.0 if args.quick else 1024.0
    if args.repeats is None:
        args.repeats = 3 if args.tiny else 5 if args.quick else 15
    if args.rss is None and args.tiny:
        args.rss = "none"
    if args.tiny and args.models == build_parser().get_default("models"):
        args.models = ["mlp"]
    import jax

    table = DEPTHS_TINY if args.tiny else DEPTHS_QUICK if args.quick else DEPTHS_FULL
    results: dict[str, Any] = {
        "device": str(jax.devices()[0].device_kind),
        "models": {},
    }
    for model in args.models:
        depths = args.depths or table[model]
        results["models"][model] = sweep_model(model, depths, args)
    config = {
        key: getattr(args, key)
        for key in (
            "quick",
            "tiny",
            "models",
            "methods",
            "depths",
            "batch",
            "budget_mib",
            "repeats",
            "rss",
        )
    }
    config["sizes"] = {m: r["sizes"] for m, r in results["models"].items()}
    config["depths_used"] = {m: r["depths"] for m, r in results["models"].items()}
    results["summary"] = summarize(results)
    common.write_json(args.out, "memory", config, results)
    plot(results, args.out)
    return 0


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Ratios at the largest depth of each model, for the report and the tests."""
    summary: dict[str, Any] = {}
    for name, res in results["models"].items():
        rows = res.get("rows") or []
        if not rows:
            summary[name] = {"missing": res.get("missing")}
            continue
        top = max(r["depth"] for r in rows)
        at_top = {r["method"]: r for r in rows if r["depth"] == top}
        rev = [r for r in rows if r["method"] == "reversible"]
        entry: dict[str, Any] = {"largest_depth": top, "missing": res.get("missing")}
        for method, row in at_top.items():
            entry[method] = {
                k: row.get(k)
                for k in (
                    "temp_bytes",
                    "temp_ratio",
                    "flops_ratio",
                    "time_ratio",
                    "time_ratio_min",
                    "time_ratio_max",
                    "time_vs_best_plain",
                    "temp_vs_best_plain",
                )
            }
        if rev:
            temps = [r["temp_bytes"] for r in rev]
            entry["reversible_temp_spread"] = max(temps) / max(min(temps), 1.0)
        if "standard" in at_top and "reversible" in at_top:
            entry["standard_over_reversible_temp"] = at_top["standard"][
                "temp_bytes"
            ] / max(at_top["reversible"]["temp_bytes"], 1.0)
        if "generic" in at_top and "reversible" in at_top:
            entry["generic_over_sequence"] = {
                "temp": at_top["generic"]["temp_bytes"]
                / max(at_top["reversible"]["temp_bytes"], 1.0),
                "flops": at_top["generic"]["flops"] / at_top["reversible"]["flops"],
            }
        summary[name] = entry
    return summary


if __name__ == "__main__":
    sys.exit(main())
