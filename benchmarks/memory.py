"""Memory, FLOPs and time of training the same parameters every way, vs depth.

For each model of :mod:`benchmarks.models` (an MLP coupling stack, the peers'
conv stack, the CIFAR-shaped ``RevNet``, the ``ReversibleTransformer``) and
depth, the same parameters are trained with every method there. Ratios are to
the ``standard`` twin and to the *best plain* baseline (the faster of ``plain``
and ``layer_stack``). Per configuration: compiled temp memory, FLOPs (a scan
body counted once, so the MLP is also measured unrolled at depths 2 and 4 for
true per-block FLOPs), median step time over interleaved runs, peak RSS of real
training steps in a fresh process, and the largest depth and batch each method
fits into a memory budget (searched by compiling).

    python -m benchmarks.memory [--quick | --tiny] [--out results]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchmarks import measure, models

NAME = "memory"
DEPTHS = {
    "full": {
        "mlp": [2, 4, 8, 16, 32, 64, 128],
        "conv": [2, 4, 8, 16, 32, 64],
        "revnet": [1, 2, 4, 9, 18],
        "transformer": [2, 4, 8, 16, 32, 64],
    },
    # --quick fits `make demo`: a RevNet step compiles in 5-9 s on 2 cores.
    "quick": {
        "mlp": [2, 8, 32],
        "conv": [2, 8],
        "revnet": [1, 3],
        "transformer": [2, 8, 32],
    },
    "tiny": {"mlp": [2, 8, 32]},
}
STYLES = {
    "standard": ("tab:red", "o"),
    "checkpoint": ("tab:orange", "s"),
    "reversible": ("tab:green", "^"),
    "generic": ("tab:blue", "x"),
    "plain": ("tab:purple", "D"),
    "layer_stack": ("tab:brown", "v"),
}


def largest_fitting(
    measure_n: Callable[[int], float], budget: float, guess: int, cap: int
) -> tuple[int | None, int]:
    """Largest ``n`` in ``[1, cap]`` with ``measure_n(n) <= budget``, and calls.

    Assumes ``measure_n`` grows with ``n`` and is close to affine: each step
    extrapolates through the measured points (secant), then bisects.
    """
    seen: dict[int, float] = {}
    lo, hi = 0, cap + 1  # lo fits, hi does not
    n = min(max(1, guess), cap)
    while True:
        if n not in seen:
            seen[n] = measure_n(n)
        lo, hi = (n, hi) if seen[n] <= budget else (lo, n)
        if hi - lo <= 1:
            return (lo or None), len(seen)
        a, b = min(seen), max(seen)
        slope = (seen[b] - seen[a]) / (b - a or 1)
        anchor = lo or a
        if slope > 0 and len(seen) <= 6:
            n = anchor + int((budget - seen[anchor]) // slope)
        else:
            n = min(cap, 2 * lo) if hi > cap else (lo + hi) // 2
        n = min(max(n, lo + 1), hi - 1)


def _total_bytes(spec: dict[str, Any]) -> float:
    built = models.build(spec, abstract=True)
    return measure.compile_stats(built.grad_step, *built.args)[1]["total_bytes"]


def budgets(model, sizes, rows, budget_mib, batch_too) -> dict[str, Any]:
    """Largest depth (and batch at the top depth) fitting ``budget_mib``.

    Compiling ever deeper unrolled plain stacks costs minutes, so the plain
    baselines are left out (their memory is read off the sweep).
    """
    budget, out = budget_mib * measure.MIB, {}
    for method in dict.fromkeys(r["method"] for r in rows):
        if method in models.PLAIN_METHODS:
            continue
        mine = [r for r in rows if r["method"] == method]
        top = mine[-1]
        spec = {"model": model, "method": method, **sizes, "depth": top["depth"]}
        slope = (top["total_bytes"] - mine[0]["total_bytes"]) / max(
            top["depth"] - mine[0]["depth"], 1
        )
        guess = (
            top["depth"] * 64
            if slope <= 0
            else top["depth"] + int((budget - top["total_bytes"]) / slope)
        )
        cap = 4096 if model == "mlp" else 256
        n, calls = largest_fitting(
            lambda d: _total_bytes({**spec, "depth": d}), budget, guess, cap
        )
        out[method] = {"largest_depth": n, "at_cap": n == cap, "compiles": calls}
        if batch_too:
            guess = int(budget / (top["total_bytes"] / sizes["batch"]))
            n, calls = largest_fitting(
                lambda b: _total_bytes({**spec, "batch": b}), budget, guess, 1 << 16
            )
            out[method].update(largest_batch=n, batch_depth=top["depth"])
        print(f"[memory] {model} {method} fits {budget_mib:g} MiB: {out[method]}")
    return out


def unrolled_flops(sizes: dict[str, Any], methods: Sequence[str]) -> dict[str, float]:
    """Per-block FLOPs of the MLP as an unrolled chain, from depths 2 and 4."""
    out = {}
    for method in methods:
        if method == "generic" or method in models.PLAIN_METHODS:
            continue
        flops = []
        for depth in (2, 4):
            spec = {"model": "mlp", "method": method, "depth": depth, **sizes}
            built = models.build({**spec, "unrolled": True})
            flops.append(
                measure.compile_stats(built.grad_step, *built.args)[1]["flops"]
            )
        out[method] = (flops[1] - flops[0]) / 2
    return out


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Ratios to the standard twin and to the best plain baseline, per depth."""
    for depth in {r["depth"] for r in rows}:
        at = {r["method"]: r for r in rows if r["depth"] == depth}
        timed = [m for m in models.PLAIN_METHODS if m in at]
        best = at[min(timed, key=lambda m: at[m]["median_s"])] if timed else None
        ref = at.get("standard")
        for row in at.values():
            if best is not None:
                row["best_plain"] = best["method"]
                row["time_vs_best_plain"] = row["median_s"] / best["median_s"]
                row["temp_vs_best_plain"] = row["temp_bytes"] / max(
                    best["temp_bytes"], 1.0
                )
            if ref is not None:
                row["temp_ratio"] = row["temp_bytes"] / max(ref["temp_bytes"], 1.0)
                row["flops_ratio"] = row["flops"] / ref["flops"]
                for suffix, key in (
                    ("", "median_s"),
                    ("_min", "min_s"),
                    ("_max", "max_s"),
                ):
                    row["time_ratio" + suffix] = row[key] / ref[key]


def sweep(model: str, depths: list[int], size: str) -> dict[str, Any]:
    """One model over depths and methods; see the module docstring."""
    sizes = models.default_sizes(model, size != "full")
    if size == "tiny":
        sizes = {"width": 64, "batch": 128}
    methods = [m for m in models.METHODS if m != "generic" or model == "mlp"]
    rows, missing = [], {}
    for depth in depths:
        compiled, init = {}, None  # one init per depth, shared by every method
        for method in methods:
            spec = {"model": model, "method": method, "depth": depth, **sizes}
            try:
                built = models.build(spec, init=init)
            except models.Unavailable as err:
                missing[method] = str(err)
                continue
            init = built.init
            exe, stats = measure.compile_stats(built.grad_step, *built.args)
            compiled[method] = lambda e=exe, a=built.args: e(*a)
            row = {"depth": depth, "method": method, "num_params": built.num_params}
            if built.remat_calls is not None:
                row["remat_calls_at_trace"] = built.remat_calls[0]
            rows.append({**row, **stats})
            print(f"[memory] {model} depth {depth} {method}: {stats}", flush=True)
        repeats = {"tiny": 3, "quick": 5, "full": 15}[size]
        for method, t in measure.median_times(compiled, repeats).items():
            next(
                r for r in rows if r["depth"] == depth and r["method"] == method
            ).update(t)
    result = {"sizes": sizes, "depths": depths, "methods": methods, "rows": rows}
    result["missing"] = missing
    if not rows:
        return result
    add_ratios(rows)
    quick_mlp = size == "quick" and model == "mlp"
    if size == "full" or quick_mlp or size == "tiny":
        budget_mib = 1024.0 if size == "full" else 64.0
        result["budget_mib"] = budget_mib
        result["budget"] = budgets(model, sizes, rows, budget_mib, size != "tiny")
    if model == "mlp" and size != "tiny":
        result["unrolled_flops"] = unrolled_flops(sizes, methods)
    if size == "full" or quick_mlp:  # peak RSS at the largest depth, 2 at a time
        jobs = [
            {"model": model, "method": m, "depth": depths[-1], **sizes}
            for m in methods
            if m not in missing
        ]
        with ThreadPoolExecutor(max_workers=2) as pool:
            got = pool.map(lambda s: measure.run_worker("benchmarks.models", s), jobs)
            result["rss"] = [
                {"depth": s["depth"], "method": s["method"], **r}
                for s, r in zip(jobs, got)
            ]
    return result


def plot(results: dict[str, Any], out: str) -> str:
    """Memory, FLOP ratio and time ratio against depth, one row per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [m for m, r in results["models"].items() if r.get("rows")]
    fig, axes = plt.subplots(len(names), 3, figsize=(15, 4 * len(names)), squeeze=False)
    for ax_row, name in zip(axes, names):
        res = results["models"][name]
        for method in res["methods"]:
            mine = [r for r in res["rows"] if r["method"] == method]
            if not mine:
                continue
            color, marker = STYLES[method]
            d = [r["depth"] for r in mine]
            kw = {"color": color, "marker": marker, "label": method}
            ax_row[0].plot(d, [r["temp_bytes"] / measure.MIB for r in mine], **kw)
            ax_row[1].plot(d, [r.get("flops_ratio", float("nan")) for r in mine], **kw)
            if all("time_ratio" in r for r in mine):
                med = [r["time_ratio"] for r in mine]
                lo = [max(m - r["time_ratio_min"], 0) for m, r in zip(med, mine)]
                hi = [max(r["time_ratio_max"] - m, 0) for m, r in zip(med, mine)]
                ax_row[2].errorbar(d, med, yerr=[lo, hi], capsize=3, **kw)
        unit = "units per stage" if name == "revnet" else "blocks"
        titles = (
            "compiled activation memory (MiB)",
            "FLOPs / standard (scan body counted once)",
            "step time / standard (median, min-max)",
        )
        ax_row[1].axhline(4 / 3, color="gray", ls="--", lw=1, label="4/3")
        ax_row[0].set_yscale("log")
        for ax, title in zip(ax_row, titles):
            ax.set(title=f"{name}: {title}", xlabel=f"depth ({unit})")
            ax.set_xscale("log", base=2)
            ax.set_xticks(res["depths"], [str(d) for d in res["depths"]])
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    return measure.save_figure(fig, out, NAME)


def main(argv: Sequence[str] | None = None) -> dict:
    """Runs the sweep; writes ``<out>/memory.json`` and ``memory.png``."""
    args = measure.parse(__doc__, argv)
    size = "tiny" if args.tiny else "quick" if args.quick else "full"
    results = {"size": size, "models": {}}
    for model, depths in DEPTHS[size].items():
        results["models"][model] = sweep(model, depths, size)
    plot(results, args.out)
    return measure.write_json(args.out, NAME, results)


def markdown(results: dict, out: str) -> str:
    """Per model: the sweep table, unrolled FLOPs, budgets and RSS."""
    parts = [
        "## Memory, FLOPs and time vs depth",
        "The same parameters trained every way (see `benchmarks/models.py`): "
        "`plain` (a Python loop of the blocks) and `layer_stack` are what a user "
        "writes without revnet; *best plain* is the faster of them at each depth. "
        "Memory is the compiled `temp_size_in_bytes`; FLOPs from `cost_analysis()` "
        "count a scan body once, so they are per-block ratios of scanned stacks "
        "(the unrolled MLP gives the true per-block cost). Step time: median over "
        "interleaved runs, min/max the ratio of the fastest (slowest) runs.",
        f"![memory]({NAME}.png)",
    ]
    for name, res in results["models"].items():
        missing = f" Missing: {res['missing']}" if res["missing"] else ""
        parts.append(f"### {name}\n\nSizes: `{res['sizes']}`.{missing}")
        keys = ("temp_ratio", "flops_ratio", "time_ratio", "time_ratio_min")
        keys += ("time_ratio_max", "time_vs_best_plain", "temp_vs_best_plain")
        head = ["depth", "method", "temp MiB", "temp / std", "FLOPs / std"]
        head += ["time / std", "min", "max", "time / best plain", "temp / best plain"]
        parts.append(
            measure.table(
                head,
                [
                    [r["depth"], r["method"], r["temp_bytes"] / measure.MIB]
                    + [r.get(k) for k in keys]
                    for r in res["rows"]
                ],
            )
        )
        flops = res.get("unrolled_flops") or {}
        if flops.get("standard"):
            rows = [[m, f, f / flops["standard"]] for m, f in flops.items()]
            parts += ["Unrolled per-block FLOPs (depths 2 and 4):"]
            parts.append(measure.table(["method", "FLOPs per block", "/ std"], rows))
        if res.get("budget"):
            parts.append(
                f"Largest fitting {res['budget_mib']:g} MiB (arguments + outputs + "
                "temporaries of the compiled step):"
            )
            rows = [
                [
                    m,
                    ("≥" if b["at_cap"] else "") + str(b["largest_depth"]),
                    b.get("largest_batch"),
                ]
                for m, b in res["budget"].items()
            ]
            parts.append(
                measure.table(["method", "largest depth", "largest batch"], rows)
            )
        rss = [r for r in res.get("rss", []) if "peak_rss_mib" in r]
        if rss:
            parts.append(
                "Resident memory of real training steps, one process each; the "
                "step columns reset the high-water mark just before the steps."
            )
            keys = ("peak_rss_mib", "rss_before_step_mib", "step_peak_rss_mib")
            keys += ("step_rss_increase_mib", "step_hwm_reset")
            head = ["depth", "method", "process peak MiB", "before steps MiB"]
            head += ["step peak MiB", "step increase MiB", "peak reset"]
            rows = [[r["depth"], r["method"]] + [r.get(k) for k in keys] for r in rss]
            parts.append(measure.table(head, rows))
    return "\n\n".join(parts)


if __name__ == "__main__":
    main()
