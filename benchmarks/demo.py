"""The demo (``make demo``): revnet's story in a few minutes on 2 CPU cores.

Three measurements, made with the benchmarks' own code, and one report:

1. **Training.** ``examples/digits.py`` (as :mod:`benchmarks.training` runs
   it): a small RevNet on scikit-learn's digits, trained reversible and
   standard from the same initialisation on the same batches, for its default
   10 epochs; the largest difference between the twins' gradients at the same
   parameters, each epoch.
2. **Memory against depth.** The compiled temp memory
   (``memory_analysis().temp_size_in_bytes``) of one training step of the MLP
   coupling stack of :mod:`benchmarks.models`, on the same parameters:
   reversible, standard backprop, and JAX's best remat (``hk.remat``, that is
   ``jax.checkpoint``, around every layer of the scanned stack).
3. **Step time at one size**: the median of interleaved timings of the same
   three steps, as ratios to standard backprop.

Writes ``<out>/demo.json``, ``<out>/demo.png`` and ``<out>/REPORT.md``. The
full benchmark set is ``make demo-full`` (``python -m benchmarks.run --quick``).

    python -m benchmarks.demo [--tiny] [--out results]

``--tiny`` is the smallest run, for tests: a smoke training run and a short
memory sweep, with no timings. ``--quick`` is the default size.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Sequence
from typing import Any

from benchmarks import measure, memory, models, training
from benchmarks.run import progress

NAME = "demo"
MODEL = "mlp"
METHODS = ("standard", "checkpoint", "reversible")
LABELS = {
    "standard": "standard backprop (scan)",
    "checkpoint": "jax.checkpoint per layer + scan (hk.remat)",
    "reversible": "reversible (revnet)",
}
SIZES = {
    "demo": {
        "epochs": 10,
        "width": 256,
        "batch": 512,
        "depths": [2, 4, 8, 16, 32, 64, 128],
        "time_depth": 16,
        "repeats": 15,
    },
    # Everything runs, nothing is a result: a smoke training run, no timings.
    "tiny": {
        "epochs": None,
        "width": 64,
        "batch": 128,
        "depths": [2, 8, 32],
        "time_depth": None,
        "repeats": 0,
    },
}
DIGITS_NET = "units (2, 2), widths 16 and 32"  # examples/digits.py's
SMOKE_NET = "units (1,), width 8, 3 steps an epoch (its --smoke size)"
FULL_SET = (
    "about 23 min on 2 cores (the last full measurement, before this demo "
    "existed; over 49 min on 2 cores shared with other jobs)"
)


def train_twins(size: dict[str, Any], out: str) -> dict[str, Any]:
    """Runs ``examples/digits.py``; returns its JSON (config, memory, history)."""
    folder = os.path.join(out, NAME, "digits")
    shutil.rmtree(folder, ignore_errors=True)  # fresh: digits would resume
    flags = ["--smoke"] if size["epochs"] is None else ["--epochs", str(size["epochs"])]
    training._run("digits", [*flags, "--out", folder])
    with open(os.path.join(folder, "digits.json")) as f:
        return json.load(f)


def memory_sweep(size: dict[str, Any]) -> list[dict[str, Any]]:
    """Compiled temp memory and FLOPs of each method's step, at every depth."""
    rows = []
    for depth in size["depths"]:
        for method in METHODS:
            spec = {"model": MODEL, "method": method, "depth": depth}
            spec.update(width=size["width"], batch=size["batch"])
            built = models.build(spec, abstract=True)
            stats = measure.compile_stats(built.grad_step, *built.args)[1]
            rows.append({"depth": depth, "method": method, **stats})
    for row in rows:  # FLOPs per block: every method here scans one block
        std = next(
            r for r in rows if r["depth"] == row["depth"] and r["method"] == "standard"
        )
        row["temp_vs_standard"] = row["temp_bytes"] / max(std["temp_bytes"], 1.0)
        row["flops_vs_standard"] = row["flops"] / std["flops"]
    return rows


def step_times(size: dict[str, Any]) -> dict[str, Any]:
    """Median step times at ``time_depth``, interleaved; ratios to standard."""
    depth, init, fns = size["time_depth"], None, {}
    for method in METHODS:
        spec = {"model": MODEL, "method": method, "depth": depth}
        spec.update(width=size["width"], batch=size["batch"])
        built = models.build(spec, init=init)
        init = built.init  # every method trains the very same parameters
        exe = measure.compile_stats(built.grad_step, *built.args)[0]
        fns[method] = lambda e=exe, a=built.args: e(*a)
    times = measure.median_times(fns, size["repeats"])
    base = times["standard"]
    for entry in times.values():
        entry["vs_standard"] = entry["median_s"] / base["median_s"]
        spread = measure.ratio_spread(entry["samples_s"], base["samples_s"])
        entry["vs_standard_min"] = spread and spread["min"]
        entry["vs_standard_max"] = spread and spread["max"]
    return {"depth": depth, "repeats": size["repeats"], "methods": times}


def figure(results: dict[str, Any]) -> Any:
    """Memory against depth, and the twins' training loss (not for a smoke run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    styles = memory.STYLES
    smoke = results["train"]["config"].get("smoke")
    if smoke:  # a smoke run's loss curve is not a result: memory only
        fig, mem = plt.subplots(figsize=(7.5, 4.6))
    else:
        fig, (mem, loss) = plt.subplots(
            1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [3, 2]}
        )
    rows, depths = results["memory"], results["sizes"]["depths"]
    series = []
    for method in METHODS:
        mine = [r for r in rows if r["method"] == method]
        color, marker = styles[method]
        series.append(
            {
                "label": LABELS[method],
                "x": [r["depth"] for r in mine],
                "y": [r["temp_bytes"] / measure.MIB for r in mine],
                "color": color,
                "marker": marker,
            }
        )
    measure.plot_lines(mem, series, log_y=True)
    sizes = results["sizes"]
    mem.set_title(
        "compiled memory of one training step vs depth\n"
        f"MLP coupling stack, width {sizes['width']}, batch {sizes['batch']}, "
        "float32, same parameters",
        fontsize=10,
    )
    mem.set(xlabel="depth (coupling blocks)", ylabel="temp MiB (memory_analysis)")
    mem.set_xscale("log", base=2)
    mem.set_yscale("log")
    mem.set_xticks(depths, [str(d) for d in depths])
    plain_numbers = matplotlib.ticker.FormatStrFormatter("%g")

    def log_ticks(axis):  # 1, 2, 5, 10, 20, ... as plain numbers
        axis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(plain_numbers)
        axis.set_minor_formatter(matplotlib.ticker.NullFormatter())

    log_ticks(mem.yaxis)
    mem.grid(True, which="both", alpha=0.3)
    mem.legend(fontsize=8)
    if smoke:
        fig.tight_layout()
        return fig

    digits = results["train"]
    history = digits["history"]
    epochs = [r["epoch"] for r in history]
    twins = [
        {
            "label": twin,
            "x": epochs,
            "y": [r["loss"][twin] for r in history],
            "color": styles[twin][0],
            "marker": styles[twin][1],
        }
        for twin in ("reversible", "standard")
    ]
    measure.plot_lines(loss, twins, log_y=True)  # the twins may coincide
    gap = max(r["grad_max_abs_diff"] for r in history)
    acc = history[-1]["test_accuracy"]
    loss.set_title(
        "digits RevNet: training loss, twins from one init\n"
        f"test accuracy {acc['reversible']:.3f} / {acc['standard']:.3f}; "
        f"largest gradient difference {gap:.1e}",
        fontsize=10,
    )
    loss.set(xlabel="epoch", ylabel="mean training loss", yscale="log")
    log_ticks(loss.yaxis)
    loss.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    loss.grid(True, which="both", alpha=0.3)
    loss.legend(fontsize=8)
    fig.tight_layout()
    return fig


def main(argv: Sequence[str] | None = None) -> dict:
    """Runs the three parts; writes ``demo.json``, ``demo.png``, ``REPORT.md``."""
    args = measure.parse(__doc__, argv)
    name = "tiny" if args.tiny else "demo"
    size = SIZES[name]
    results: dict[str, Any] = {"size": name, "sizes": size, "seconds": {}}
    parts = {
        "train": lambda: train_twins(size, args.out),
        "memory": lambda: memory_sweep(size),
        "time": lambda: step_times(size) if size["repeats"] else None,
    }
    start = time.perf_counter()
    for part in progress(list(parts), "demo"):
        t = time.perf_counter()
        results[part] = parts[part]()
        results["seconds"][part] = round(time.perf_counter() - t, 1)
    results["figure"] = measure.save_figure(figure(results), args.out, NAME)
    results["seconds"]["total"] = round(time.perf_counter() - start, 1)
    measure.write_json(args.out, NAME, results)
    text = markdown(results, args.out)
    measure.atomic_write(os.path.join(args.out, "REPORT.md"), text.encode())
    print(f"[demo] wrote {os.path.join(args.out, 'REPORT.md')}", flush=True)
    return results


def _training_section(digits: dict[str, Any]) -> list[str]:
    config, history = digits["config"], digits["history"]
    temp = digits["temp_bytes"]
    gap = max(r["grad_max_abs_diff"] for r in history)
    scale = max(r["grad_max_abs"] for r in history)
    smoke = config.get("smoke")
    parts = [
        "## 1. The same model, trained reversible and standard",
        "`examples/digits.py`: a RevNet on scikit-learn's digits (8×8 images), "
        "trained as a reversible and a standard twin from the same "
        "initialisation, on the same batches; they differ only in `reversible`. "
        f"Sizes: {SMOKE_NET if smoke else DIGITS_NET}, "
        f"batch {config['batch']}, SGD (lr {config['lr']}, momentum 0.9), "
        f"{config['epochs']} epochs, seed {config['seed']}.",
    ]
    if smoke:
        parts.append(
            "**Smoke run, not a result**: a few steps of a toy network, only to "
            "show that it runs; its losses and accuracies mean nothing and are "
            "left out."
        )
    head = ["epoch", "gradient max abs diff", "max abs gradient"]
    if not smoke:
        head += ["loss reversible", "loss standard"]
        head += ["test acc. reversible", "test acc. standard"]
    rows = []
    for r in history:
        row = [r["epoch"], r["grad_max_abs_diff"], r["grad_max_abs"]]
        if not smoke:
            row += [r["loss"]["reversible"], r["loss"]["standard"]]
            row += [r["test_accuracy"]["reversible"], r["test_accuracy"]["standard"]]
        rows.append(row)
    parts.append(measure.table(head, rows))
    parts.append(
        f"Largest difference between the twins' gradients at the same "
        f"parameters (the reversible twin's, one batch each epoch): **{gap:.2e}**, "
        f"for gradients up to {scale:.2e}: the reversible backward pass rebuilds "
        "the activations instead of storing them and agrees with backprop to "
        "float32 rounding. Compiled training step temp memory: "
        f"{temp['reversible'] / measure.MIB:.3f} MiB reversible, "
        f"{temp['standard'] / measure.MIB:.3f} MiB standard."
    )
    return parts


def _memory_section(results: dict[str, Any]) -> list[str]:
    sizes, rows = results["sizes"], results["memory"]
    depths = sizes["depths"]
    by = {(r["method"], r["depth"]): r for r in rows}
    top = depths[-1]
    head = ["method"] + [f"depth {d}" for d in depths]
    head += [f"/ standard at {top}", "FLOPs / standard (per block)"]
    table = []
    for method in METHODS:
        row = [LABELS[method]]
        row += [f"{by[method, d]['temp_bytes'] / measure.MIB:.2f}" for d in depths]
        row += [
            by[method, top]["temp_vs_standard"],
            by[method, top]["flops_vs_standard"],
        ]
        table.append(row)
    rev = [by["reversible", d]["temp_bytes"] for d in depths]
    std = [by["standard", d]["temp_bytes"] for d in depths]
    return [
        "## 2. Compiled memory of one training step against depth",
        f"The MLP coupling stack of `benchmarks/models.py` (additive couplings, "
        f"tanh, width {sizes['width']}, batch {sizes['batch']}, float32), the "
        "same parameters trained three ways. Memory is XLA's planned temp memory "
        "of the compiled `jit(value_and_grad)` step "
        "(`memory_analysis().temp_size_in_bytes`, deterministic), in MiB. FLOPs "
        "from `cost_analysis()` count one scan body, so their ratio is per block "
        "(RevNet's recompute costs about 4/3).",
        measure.table(head, table),
        f"From depth {depths[0]} to {top}, reversible goes from "
        f"{rev[0] / measure.MIB:.2f} to {rev[-1] / measure.MIB:.2f} MiB, standard "
        f"from {std[0] / measure.MIB:.2f} to {std[-1] / measure.MIB:.2f} MiB "
        f"({std[-1] / max(rev[-1], 1.0):.1f}× reversible at depth {top}).",
    ]


def _time_section(results: dict[str, Any]) -> list[str]:
    timed = results.get("time")
    parts = ["## 3. Step time at one size"]
    if not timed:
        parts.append(
            "Left out of this tiny run: at these sizes, with so few timings, a "
            "step-time ratio would mean nothing."
        )
        return parts
    sizes = results["sizes"]
    rows = []
    for method, t in timed["methods"].items():
        lo, hi = t.get("vs_standard_min"), t.get("vs_standard_max")
        rows.append(
            [
                LABELS[method],
                1e3 * t["median_s"],
                f"{1e3 * t['min_s']:.3g}–{1e3 * t['max_s']:.3g}",
                t["vs_standard"],
                None if lo is None else f"{lo:.3g}–{hi:.3g}",
            ]
        )
    head = ["method", "step ms (median)", "min–max ms", "/ standard (median)"]
    head += ["per-round ratio min–max"]
    rev = timed["methods"]["reversible"]["vs_standard"]
    parts += [
        f"MLP coupling stack at depth {timed['depth']}, width {sizes['width']}, "
        f"batch {sizes['batch']}: the **median of {timed['repeats']} timings** "
        "of each compiled training step, taken in interleaved rounds after "
        "warm-up, on a shared machine (single timings move by ±50%).",
        measure.table(head, rows),
        f"Reversible takes {rev:.2f}× standard backprop's step time here (ratio "
        "of the medians). It runs each block's forward again in the backward "
        "pass (the FLOP ratio above), and touches far less memory.",
    ]
    return parts


def markdown(results: dict, out: str) -> str:
    """``REPORT.md``: what was run at which sizes, the figure, three sections."""
    del out  # the figure is referenced relative to the report
    m = results.get("machine", {})
    tiny = results["size"] == "tiny"
    sizes = results["sizes"]
    head = ["# revnet demo: reversible training in flat memory"]
    if tiny:
        head.append(
            "**Tiny run (`--tiny`): the smallest sizes, only to show that the "
            "demo runs. The training is a smoke run and there are no timings; "
            "nothing here is a result.** `make demo` gives the real figures."
        )
    seconds = results["seconds"]
    epochs = sizes["epochs"]
    training = "smoke run" if epochs is None else f"{epochs} epochs"
    head.append(
        f"Sizes: digits RevNet {training}; "
        f"MLP coupling stack width {sizes['width']}, batch {sizes['batch']}, "
        f"depths {', '.join(map(str, sizes['depths']))}"
        + (
            f"; step time at depth {sizes['time_depth']}, median of "
            f"{sizes['repeats']} timings."
            if sizes["repeats"]
            else "; no timings."
        )
        + f" Ran in {seconds.get('total', 0):.0f} s "
        f"({', '.join(f'{k} {v:g} s' for k, v in seconds.items() if k != 'total')}) "
        f"on {m.get('cpu_count', '?')} CPU cores ({m.get('backend', '?')}), "
        f"JAX {m.get('jax', '?')}, {m.get('time_utc', '')}."
    )
    head.append(f"![demo]({results['figure']})")
    parts = head + _training_section(results["train"])
    parts += _memory_section(results) + _time_section(results)
    parts += [
        "## The full benchmark set",
        "`make demo-full` runs every benchmark of `benchmarks/__init__.py` at its "
        "`--quick` size (`python -m benchmarks.run --quick --out results/full`), "
        f"{FULL_SET}, and writes `results/full/REPORT.md`.",
    ]
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    main()
