"""Memory, FLOPs and time of training the same parameters every way, vs depth.

For each model of :mod:`benchmarks.models` (an MLP coupling stack, the peers'
conv stack, the CIFAR-shaped ``RevNet``, the ``ReversibleTransformer``) and
depth, the same parameters are trained with every method there. Step time is
compared with the *best plain* baseline (the faster of ``plain`` and
``layer_stack`` at that depth), memory with it and with the ``standard`` twin,
FLOPs with the twin among scanned stacks only. Per configuration: compiled temp
memory, FLOPs (a scan body counted once, so the MLP is also measured unrolled
at depths 2 and 4 for true per-block FLOPs), median step time over interleaved
runs (and per-round ratios for the spread), peak RSS of real
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
    "layer_stack_remat": ("tab:gray", "P"),
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
    """Per-block FLOPs of the MLP as an unrolled chain, from depths 2 and 4.

    ``plain`` is unrolled already; the others are built as unrolled twins.
    """
    out = {}
    for method in methods:
        if method == "generic" or (
            method in models.PLAIN_METHODS and method not in models.UNROLLED_METHODS
        ):
            continue
        flops = []
        for depth in (2, 4):
            spec = {"model": "mlp", "method": method, "depth": depth, **sizes}
            if method not in models.UNROLLED_METHODS:
                spec["unrolled"] = True
            built = models.build(spec)
            flops.append(
                measure.compile_stats(built.grad_step, *built.args)[1]["flops"]
            )
        out[method] = (flops[1] - flops[0]) / 2
    return out


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Per depth: ratios to the best plain baseline, and to the standard twin.

    Time is compared with the best plain baseline only
    (:func:`models.compare_to_best_plain`). Memory is also compared with the
    standard twin, and so are FLOPs, but only for scanned methods (``cost_analysis``
    counts a scan body once, so those are per-block ratios; an unrolled
    method's count grows with depth and is not comparable).
    """
    for depth in sorted({r["depth"] for r in rows}):
        at = {r["method"]: r for r in rows if r["depth"] == depth}
        models.compare_to_best_plain(at)
        ref = at.get("standard")
        if ref is None:
            continue
        for row in at.values():
            row["temp_ratio"] = row["temp_bytes"] / max(ref["temp_bytes"], 1.0)
            if row["method"] not in models.UNROLLED_METHODS:
                row["flops_ratio"] = row["flops"] / ref["flops"]


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
    if model == "mlp":
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


def best_plain_note(rows: list[dict[str, Any]]) -> str:
    """Which plain baseline was fastest at which depths: ``"plain (2, 8)"``."""
    at: dict[str, list[str]] = {}
    for depth in sorted({r["depth"] for r in rows}):
        best = next((r.get("best_plain") for r in rows if r["depth"] == depth), None)
        if best is not None:
            at.setdefault(best, []).append(str(depth))
    return "; ".join(f"{m} ({', '.join(d)})" for m, d in at.items())


def panels(res: dict[str, Any]) -> list[dict[str, Any]]:
    """One model's three panels: title, y label, log scale and series.

    Memory: every method. FLOPs: the scanned methods only, as ratios to the
    standard twin (per block: ``cost_analysis`` counts one scan body), the
    unrolled ones named as left out. Step time: every timed method over the
    best plain baseline at each depth, bars the min-max of per-round ratios,
    dodged sideways.
    """
    rows = res["rows"]
    memory, flops, time = [], [], []
    for method in res["methods"]:
        mine = [r for r in rows if r["method"] == method]
        if not mine:
            continue
        color, marker = STYLES[method]
        d = [r["depth"] for r in mine]
        line = {"label": method, "x": d, "color": color, "marker": marker}
        memory.append({**line, "y": [r["temp_bytes"] / measure.MIB for r in mine]})
        if all("flops_ratio" in r for r in mine):
            flops.append({**line, "y": [r["flops_ratio"] for r in mine]})
        if all("time_vs_best_plain" in r for r in mine):
            med = [r["time_vs_best_plain"] for r in mine]
            lo = [r.get("time_vs_best_plain_min", m) for r, m in zip(mine, med)]
            hi = [r.get("time_vs_best_plain_max", m) for r, m in zip(mine, med)]
            err = [
                [max(m - a, 0.0) for m, a in zip(med, lo)],
                [max(b - m, 0.0) for m, b in zip(med, hi)],
            ]
            time.append({**line, "y": med, "yerr": err})
    # Bars at one depth are dodged sideways, so that none covers another.
    for i, line in enumerate(time):
        shift = 2 ** (0.04 * (i - (len(time) - 1) / 2))
        line["x"] = [x * shift for x in line["x"]]
    left_out = [
        m
        for m in res["methods"]
        if m in models.UNROLLED_METHODS and any(r["method"] == m for r in rows)
    ]
    flops_title = "FLOPs / standard, per block (scanned: one body counted)"
    if left_out:
        flops_title += f"\n{', '.join(left_out)} left out: unrolled, not comparable"
    return [
        {
            "title": "compiled activation memory (MiB)",
            "ylabel": "temp MiB",
            "log_y": True,
            "series": memory,
        },
        {
            "title": flops_title,
            "ylabel": "FLOPs / standard's",
            "log_y": False,
            "series": flops,
            "hline": (4 / 3, "4/3 (RevNet's recompute)"),
        },
        {
            "title": "step time / best plain\n(median; bars: min-max of per-round "
            "ratios)",
            "ylabel": "÷ best plain (faster of plain, layer_stack), log",
            "log_y": True,  # a slow round on a shared machine stays in view
            "series": time,
            "hline": (1.0, f"best plain: {best_plain_note(rows)}"),
        },
    ]


def figure(results: dict[str, Any]) -> Any:
    """The matplotlib figure of :func:`plot`: one row of :func:`panels` per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    names = [m for m, r in results["models"].items() if r.get("rows")]
    tiny = results.get("size") == "tiny"
    fig, axes = plt.subplots(
        len(names), 3, figsize=(16, 5.8 * len(names)), squeeze=False
    )
    for ax_row, name in zip(axes, names):
        res = results["models"][name]
        unit = "units per stage" if name == "revnet" else "blocks"
        for ax, panel in zip(ax_row, panels(res)):
            measure.plot_lines(ax, panel["series"], panel["log_y"])
            if "hline" in panel:
                y, label = panel["hline"]
                ax.axhline(y, color="gray", ls=":", lw=1.2, label=label)
            title = f"{name}: {panel['title']}"
            if tiny and panel["title"].startswith("step time"):
                title = f"{name}: TINY RUN, NOT A RESULT\n{panel['title']}"
            ax.set_title(title, fontsize=10)
            ax.set(xlabel=f"depth ({unit})", ylabel=panel["ylabel"])
            if panel["log_y"]:
                ax.set_yscale("log")
                plain_numbers = matplotlib.ticker.FormatStrFormatter("%g")
                ax.yaxis.set_major_formatter(plain_numbers)
                ax.yaxis.set_minor_formatter(plain_numbers)
            ax.set_xscale("log", base=2)
            ax.set_xticks(res["depths"], [str(d) for d in res["depths"]])
            ax.grid(True, which="both", alpha=0.3)
            # Below the axes: inside, a legend may cover points or bars.
            ax.legend(
                fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.14)
            )
    fig.tight_layout()
    return fig


def plot(results: dict[str, Any], out: str) -> str:
    """Writes ``<out>/memory.png`` (memory, FLOPs, time vs depth per model)."""
    return measure.save_figure(figure(results), out, NAME)


def main(argv: Sequence[str] | None = None) -> dict:
    """Runs the sweep; writes ``<out>/memory.json`` and ``memory.png``."""
    args = measure.parse(__doc__, argv)
    size = args.size
    results = {"size": size, "models": {}}
    for model, depths in DEPTHS[size].items():
        results["models"][model] = sweep(model, depths, size)
    plot(results, args.out)
    return measure.write_json(args.out, NAME, results)


TABLE_HEAD = ["depth", "method", "temp MiB", "temp / std", "FLOPs / std"]
TABLE_HEAD += ["step ms (median)", "min–max ms", "time / best plain (median)"]
TABLE_HEAD += ["per-round ratio min–max", "temp / best plain"]


def _span(lo: float | None, hi: float | None, scale: float = 1.0) -> str | None:
    if lo is None or hi is None:
        return None
    return f"{scale * lo:.3g}–{scale * hi:.3g}"


def table_row(r: dict[str, Any]) -> list[Any]:
    """One sweep row under :data:`TABLE_HEAD`; the best plain method is marked."""
    mark = " (best plain)" if r["method"] == r.get("best_plain") else ""
    ms = 1e3 * r["median_s"] if "median_s" in r else None
    return [
        r["depth"],
        r["method"] + mark,
        r["temp_bytes"] / measure.MIB,
        r.get("temp_ratio"),
        r.get("flops_ratio"),
        ms,
        _span(r.get("min_s"), r.get("max_s"), 1e3),
        r.get("time_vs_best_plain"),
        _span(r.get("time_vs_best_plain_min"), r.get("time_vs_best_plain_max")),
        r.get("temp_vs_best_plain"),
    ]


TINY_TIMES = (
    "**Tiny run: step times at these toy sizes (medians of 3) mean nothing, so "
    "the time columns are left out (—) and the plot's time panels are not "
    "results; compiled memory and FLOPs are exact for the sizes stated.**"
)


def markdown(results: dict, out: str) -> str:
    """Per model: the sweep table, unrolled FLOPs, budgets and RSS.

    A ``--tiny`` sweep's step times are left out of the tables and said to be
    no result.
    """
    tiny = results.get("size") == "tiny"
    parts = [
        "## Memory, FLOPs and time vs depth",
        "The same parameters trained every way (see `benchmarks/models.py`): "
        "`plain` (a Python loop of the blocks, unrolled) and `layer_stack` are "
        "what a user writes without revnet; *best plain* is the faster of them "
        "at each depth, the baseline of every step-time ratio. Memory is the "
        "compiled `temp_size_in_bytes`. FLOPs from `cost_analysis()` count a scan "
        "body once, so they are compared only between scanned stacks, where the "
        "ratio to `standard` is per block; unrolled `plain` has none (—), and the "
        "unrolled MLP twins give the true per-block cost. Step time: the median "
        "over interleaved runs, with the fastest and slowest run (ms); the ratio "
        "to best plain is that of the medians, with the smallest and largest "
        "ratio of one round's two runs.",
        f"![memory]({NAME}.png)",
    ] + ([TINY_TIMES] if tiny else [])
    for name, res in results["models"].items():
        missing = f" Missing: {res['missing']}" if res["missing"] else ""
        parts.append(f"### {name}\n\nSizes: `{res['sizes']}`.{missing}")
        rows = [table_row(r) for r in res["rows"]]
        if tiny:  # step ms, min-max ms, time / best plain, per-round ratios
            rows = [r[:5] + [None] * 4 + r[9:] for r in rows]
        parts.append(measure.table(TABLE_HEAD, rows))
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
