"""The benchmarks: their --tiny runs, the report, the entries and the helpers.

The ``slow`` tests run each benchmark as a user does (``python -m
benchmarks.NAME --tiny``) and check the claims its plots and tables make on
the numbers it wrote. The others are fast: the measurement helpers on a tiny
function, the report from stored JSON, the ``experiments.NAME`` entries, and
the plain baselines training the same parameters.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import (
    BENCHMARKS,
    budget,
    demo,
    measure,
    memory,
    models,
    overhead,
    run,
    speed,
)
from tests.helpers import ROOT, assert_trees_close, tolerance

ENTRIES = ("memory", "speed", "numerics", "loops", "loop_compare", "overhead")
ENTRIES += ("demo", "report")


def python(*argv: str) -> subprocess.CompletedProcess:
    """Runs ``python *argv`` in the repository, run-time checks off."""
    env = {**os.environ, "REVNET_RUNTIME_CHECKS": "0"}
    return subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True
    )


def tiny(name: str, out) -> dict:
    """Runs the benchmark ``--tiny`` into ``out``; returns its JSON."""
    proc = python("-m", f"benchmarks.{BENCHMARKS[name]}", "--tiny", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / f"{name}.json") as f:
        results = json.load(f)
    assert results["machine"]["jax"]
    text = run.section(name, str(out))
    assert text.startswith("## ") and "Could not render" not in text, text
    return results


# ----------------------------------------------------------------- fast tests


def test_measure_helpers_on_a_tiny_function(tmp_path):
    x = jnp.ones((64, 64), jnp.float32)
    compiled, stats = measure.compile_stats(lambda a: (a @ a).sum(), x)
    assert stats["flops"] >= 2 * 64**3  # one 64 x 64 matmul
    assert stats["argument_bytes"] == 64 * 64 * 4
    assert stats["total_bytes"] >= stats["temp_bytes"] >= 0
    assert float(compiled(x)) == 64.0**3
    times = measure.median_times({"a": lambda: x + 1, "b": lambda: x * 2}, 3, 1)
    for t in times.values():
        assert t["repeats"] == 3 and 0 < t["min_s"] <= t["median_s"] <= t["max_s"]
    assert list(measure.rounds("ab", 2)) == [(0, "a"), (0, "b"), (1, "b"), (1, "a")]
    assert measure.summarize([3.0, 1.0, 2.0])["median_s"] == 2.0
    assert measure.rss_mib() > 10
    measure.write_json(str(tmp_path), "x", {"nan": float("nan"), "v": np.float32(2)})
    with open(tmp_path / "x.json") as f:
        data = json.load(f)
    assert data["nan"] is None and data["v"] == 2.0 and data["machine"]["jax"]
    assert os.listdir(tmp_path) == ["x.json"]  # no temporary file left


def test_report_from_stored_json_without_running(tmp_path):
    rows = [
        {"program": "sign", "depth": 4, "error_store": 1e-7}
        | {"error_recompute": 0.5, "temp_store": 2048, "temp_recompute": 1024}
    ]
    with open(tmp_path / "decisions.json", "w") as f:
        json.dump({"rows": rows}, f)
    with open(tmp_path / "memory.json", "w") as f:
        f.write("{}")  # renders as an error, the others still do
    proc = python("-m", "benchmarks.run", "--report-only", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "REPORT.md").read_text()
    assert "## Decisions in F" in text and "| sign | 4 | 1.00e-07 |" in text
    assert "Could not render `memory.json`" in text
    assert "No `loops.json` in this folder." in text
    assert sorted(os.listdir(tmp_path)) == [
        "REPORT.md",
        "decisions.json",
        "memory.json",
    ]


def _speed_results(size: str) -> dict:
    """A stored ``speed.json``: one row, the reversible step 43.7 times the
    best plain one (layer_stack's 12.3 ms), at half its temp memory."""
    timed = (("plain", 0.0135, 1.1, 3e6), ("layer_stack", 0.0123, 1.0, 2e6))
    timed += (("reversible", 0.5375, 43.7, 1e6),)
    methods = {
        m: {"median_s": s, "time_vs_best_plain": r, "temp_bytes": b}
        | {"time_vs_best_plain_min": 0.9 * r, "time_vs_best_plain_max": 1.1 * r}
        | {"temp_vs_best_plain": b / 2e6}
        for m, s, r, b in timed
    }
    row = {"model": "mlp", "depth": 2, "methods": methods}
    return {"size": size, "rows": [row | {"best_plain": "layer_stack"}]}


def test_a_tiny_report_says_so_at_its_top(tmp_path):
    """``benchmarks.run``'s report of a --tiny run opens with the tiny-run
    note, the size read from the JSON files (one tiny file makes the run
    tiny); a --quick report states its size instead."""
    assert run.SIZE_NOTES["tiny"].startswith("**Tiny run (`--tiny`)")
    title = "# revnet: benchmark report\n\n"
    for size, others, note in (
        ("tiny", {}, run.SIZE_NOTES["tiny"]),
        ("tiny", {"decisions": "quick"}, run.SIZE_NOTES["tiny"]),
        ("quick", {"decisions": "quick"}, run.SIZE_NOTES["quick"]),
    ):
        out = tmp_path / f"{size}-{len(others)}"
        out.mkdir()
        measure.write_json(str(out), "speed", _speed_results(size))
        for name, other in others.items():
            measure.write_json(str(out), name, {"size": other, "rows": []})
        path = run.write_report(str(out), ["speed", *others], [])
        text = open(path).read()
        assert text.startswith(title + note + "\n\n"), (size, others, text[:300])
        assert ("Tiny run" in text) == (size == "tiny"), (size, others)


def test_speed_leaves_single_timings_out_of_a_tiny_report():
    """One round (--tiny) means one timing per method: the step times, their
    ratios and the best-plain mark are left out (—), the compiled temp memory
    stays, and the heading says so; with rounds to take a median, they show."""
    tiny_text = speed.markdown(_speed_results("tiny"), "unused")
    quick_text = speed.markdown(_speed_results("quick"), "unused")
    assert "| mlp | 2 | reversible | 538 | 43.7 | 39.3–48.1 | 0.954 | 0.5 |" in (
        quick_text
    )
    assert "| mlp | 2 | layer_stack (best plain) | 12.3 | 1 |" in quick_text
    assert "## Step time against plain Haiku: tiny run, single timings left out" in (
        tiny_text
    )
    assert "| mlp | 2 | reversible | — | — | — | 0.954 | 0.5 |" in tiny_text
    assert "| mlp | 2 | layer_stack | — | — | — | 1.91 | 1 |" in tiny_text
    for figure in ("43.7", "538", "12.3", "13.5", "39.3", "best plain) |"):
        assert figure not in tiny_text, figure


def _overhead_results(repeats: int) -> dict:
    """A stored ``overhead.json`` in which every phase of the invertible
    stack takes 2 ms and of the hand-written one 3 ms (a ratio of 0.667), and
    compiling at depth 32 takes 5.43 times as long as at depth 4."""
    phases = ("trace_s", "first_call_s", "lower_s", "compile_s", "jit_grad_s")
    phases += ("eager_forward_s", "eager_grad_s")
    timings = {
        m: {k: {"median_s": s, "repeats": repeats} for k in phases}
        for m, s in (("invertible", 0.002), ("hand", 0.003))
    }
    compiled = {m: {"temp_bytes": 2**20, "flops": 4e6} for m in overhead.METHODS}
    compiled["ratio"] = {"temp_bytes": 1.0, "flops": 1.0}
    rows = [
        {"depth": d, "method": m, "repeats": max(1, repeats // 2)}
        for d in (4, 32)
        for m in overhead.METHODS
    ]
    deep = {"lower_compile_median_s": 5.43, "temp_bytes": 1.0}
    grads = {m: {"grad_rel_error": 1e-7} for m in overhead.METHODS}
    return {
        "config": {"width": 16, "batch": 8, "unrolled": 2, "depth": 4}
        | {"repeats": repeats},
        "timings": timings,
        "compiled": compiled,
        "depth_scaling": {"depths": [4, 32], "rows": rows}
        | {"deep_over_shallow": {m: deep for m in overhead.METHODS}},
        "eager_cache": {"analyses_per_warm_eager_call": 0}
        | {"jaxpr_prints_per_warm_eager_call": 0},
        "gradient_check": {"passed": True} | {d: grads for d in overhead.GRAD_RTOL},
    }


def test_overhead_leaves_ratios_of_single_timings_out_of_a_tiny_report():
    """One timing of each phase and one compile at each depth (--tiny): no
    time ratio is shown, neither invertible / hand nor deep / shallow, and the
    text says so; compiled memory and FLOPs keep theirs."""
    tiny_text = overhead.markdown(_overhead_results(1), "unused")
    quick_text = overhead.markdown(_overhead_results(7), "unused")
    row = "| warm jitted `grad` call | 2.00 ms | 3.00 ms |"
    assert f"{row} 0.667 |" in quick_text and "invertible 5.43x, 1.00x" in quick_text
    assert f"{row} — |" in tiny_text and tiny_text.count(" | — |") == 7
    assert "**Tiny run: single timings, so their ratios are left out (—).**" in (
        tiny_text
    )
    assert "0.667" not in tiny_text and "5.43" not in tiny_text
    assert "deep / shallow: invertible 1.00x; hand 1.00x" in tiny_text
    assert "its time ratio is left out" in tiny_text
    for text in (tiny_text, quick_text):
        assert "| compiled temp memory | 1.000 MiB | 1.000 MiB | 1 |" in text


def test_time_ratios_to_the_best_plain_baseline_and_their_spread():
    # Three interleaved rounds; layer_stack is the faster plain baseline.
    samples = {
        "plain": [2.0, 2.2, 2.1],
        "layer_stack": [1.0, 3.0, 1.1],
        "reversible": [1.5, 1.6, 1.4],
    }
    stats = {m: {**measure.summarize(t), "samples_s": t} for m, t in samples.items()}
    for m in stats:
        stats[m]["temp_bytes"] = 100.0
    assert models.compare_to_best_plain(stats) == "layer_stack"
    rev = stats["reversible"]
    assert rev["best_plain"] == "layer_stack"
    assert rev["time_vs_best_plain"] == pytest.approx(1.5 / 1.1)
    # Per-round ratios 1.5, 0.533, 1.273: not the ratio of the two minima
    # (1.4) nor of the maxima (0.533), which would make "min" exceed "max".
    assert rev["time_vs_best_plain_min"] == pytest.approx(1.6 / 3.0)
    assert rev["time_vs_best_plain_max"] == pytest.approx(1.5)
    for entry in stats.values():
        lo, hi = entry["time_vs_best_plain_min"], entry["time_vs_best_plain_max"]
        assert lo <= entry["time_vs_best_plain"] <= hi
    assert stats["layer_stack"]["time_vs_best_plain"] == 1.0
    # A failed round (None) is left out of the pairs, not shifted.
    assert measure.ratio_spread([1.0, None, 3.0], [1.0, 1.0, 2.0]) == {
        "min": 1.0,
        "max": 1.5,
    }
    assert measure.ratio_spread([1.0], [1.0, 2.0]) is None


def test_a_series_lying_on_another_is_named_in_the_legend():
    series = [
        {"label": "scan", "x": [1, 2, 4], "y": [1.0, 10.0, 100.0]},
        {"label": "unrolled", "x": [1, 2], "y": [1.01, 10.1]},  # on scan's part
        {"label": "flat", "x": [1, 2, 4], "y": [1.0, 1.0, 1.0]},  # meets it once
        {"label": "flat copy", "x": [1, 2, 4], "y": [1.0, 1.0, 1.0]},
    ]
    assert measure.coinciding(series, log_y=True) == [None, "scan", None, "flat"]
    # On a linear axis 1.0 and 1.01 are as close; 10 and 10.1 too (1% of 99).
    assert measure.coinciding(series[:2], log_y=False) == [None, "scan"]


def _memory_results():
    """A synthetic memory sweep: plain (unrolled) FLOPs grow with depth, generic
    lies on reversible, and the best plain baseline changes with depth."""
    times = {  # method: (depth 2, depth 8) per-round samples
        "standard": ([3.0, 3.1], [9.0, 9.2]),
        "reversible": ([2.0, 2.1], [6.0, 6.3]),
        "generic": ([2.0, 2.2], [6.1, 6.2]),
        "plain": ([1.0, 1.1], [8.0, 8.1]),
        "layer_stack": ([1.5, 1.6], [7.0, 7.2]),
    }
    temp = {"standard": 4.0, "reversible": 1.0, "generic": 1.0, "plain": 3.0}
    temp["layer_stack"] = 4.0
    flops = {"standard": 3.0, "reversible": 4.0, "generic": 4.0, "layer_stack": 3.0}
    rows = []
    for i, depth in enumerate((2, 8)):
        for method, samples in times.items():
            row = {"depth": depth, "method": method, **measure.summarize(samples[i])}
            row["samples_s"] = samples[i]
            row["temp_bytes"] = temp[method] * depth * measure.MIB
            if method == "reversible" or method == "generic":
                row["temp_bytes"] = temp[method] * measure.MIB
            row["flops"] = flops.get(method, 3.0 * depth)
            rows.append(row)
    memory.add_ratios(rows)
    res = {"sizes": {}, "depths": [2, 8], "methods": list(times), "rows": rows}
    return {"size": "tiny", "models": {"mlp": {**res, "missing": {}}}}


def test_memory_plot_titles_and_legends_agree():
    import matplotlib.pyplot as plt

    results = _memory_results()
    fig = memory.figure(results)
    try:
        mem_ax, flops_ax, time_ax = fig.axes
        labels = [
            [t.get_text() for t in ax.get_legend().get_texts()] for ax in fig.axes
        ]
        # Every method plotted is in the legend, and generic is not hidden.
        assert labels[0] == [
            "standard",
            "reversible",
            "generic (overlaps reversible)",
            "plain",
            "layer_stack (overlaps standard)",
        ]
        # FLOPs: only the scanned stacks, the unrolled one named as left out.
        assert "plain" not in " ".join(labels[1])
        assert "per block" in flops_ax.get_title()
        assert "plain left out" in flops_ax.get_title()
        # Time: over the best plain baseline, named with its depths.
        assert "step time / best plain" in time_ax.get_title()
        assert "best plain: plain (2); layer_stack (8)" in labels[2]
        assert "best plain" in time_ax.get_ylabel()
        assert not fig._suptitle  # panel titles say it all, nothing collides
    finally:
        plt.close(fig)
    rows = results["models"]["mlp"]["rows"]
    by = {(r["method"], r["depth"]): r for r in rows}
    assert "flops_ratio" not in by["plain", 8]
    assert by["reversible", 8]["flops_ratio"] == pytest.approx(4 / 3)
    assert by["reversible", 8]["time_vs_best_plain"] == pytest.approx(6.15 / 7.1)


def test_memory_table_columns_are_what_their_headings_say():
    results = _memory_results()
    tiny = memory.markdown(results, "unused")  # a tiny sweep: no step times
    assert memory.TINY_TIMES in tiny and "6.15e+03" not in tiny
    results["size"] = "quick"
    text = memory.markdown(results, "unused")
    head = "| " + " | ".join(memory.TABLE_HEAD) + " |"
    assert head in text
    rows = [line for line in text.splitlines() if line.startswith("| 8 | ")]
    cells = {line.split(" | ")[1]: line.strip("| ").split(" | ") for line in rows}
    col = {name: i for i, name in enumerate(memory.TABLE_HEAD)}
    rev = cells["reversible"]
    assert rev[col["step ms (median)"]] == "6.15e+03"
    assert rev[col["min–max ms"]] == "6e+03–6.3e+03"
    assert rev[col["FLOPs / std"]] == "1.33"
    assert cells["plain"][col["FLOPs / std"]] == "—"
    assert "layer_stack (best plain)" in cells
    lo, hi = map(float, rev[col["per-round ratio min–max"]].split("–"))
    assert lo <= float(rev[col["time / best plain (median)"]]) <= hi


@pytest.mark.parametrize("name", ENTRIES)
def test_experiments_entries_run(name):
    proc = python("-m", f"experiments.{name}", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "--out" in proc.stdout and "--tiny" in proc.stdout


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "experiments.memory", "--out", "/proc/not-writable"],
        ["-m", "benchmarks.training", "--tiny", "--out", "/proc/not-writable"],
        ["-m", "benchmarks.run", "--only", "memory,nope"],
        ["-m", "benchmarks.sharding", "--depths", "4", "0"],
        ["-m", "benchmarks.speed", "--models", "mlp,nope"],
        ["-m", "benchmarks.speed", "--depths", "16", "0"],
    ],
    ids=lambda a: " ".join(a[1:3]),
)
def test_bad_flags_end_at_once_with_one_line(argv):
    """Exit status 2 and one line on stderr, before anything runs."""
    proc = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and ": error: argument --" in lines[0], lines[:5]
    assert proc.stdout == ""


def test_one_list_names_every_benchmark_module():
    for module in BENCHMARKS.values():
        if os.path.exists(os.path.join(ROOT, "benchmarks", f"{module}.py")):
            mod = __import__(f"benchmarks.{module}", fromlist=["NAME"])
            assert BENCHMARKS[mod.NAME] == module
            assert callable(mod.main) and callable(mod.markdown)


@pytest.mark.parametrize("model", ["conv", "transformer"])
def test_plain_baselines_train_the_same_parameters(model):
    """plain, layer_stack and reversible runs of one model give the same loss
    and gradients, leaf by leaf, once the trees are put in one layout."""
    sizes = {
        "conv": {"image_size": 8, "batch": 2, "channels": 8},
        "transformer": {**models.default_sizes("transformer", True), "seq_len": 8},
    }[model]
    out, init = {}, None
    for method in ("reversible", "plain", "layer_stack"):
        built = models.build(
            {"model": model, "method": method, "depth": 2, **sizes}, init=init
        )
        init = built.init
        loss, grads, _ = jax.jit(built.grad_step)(*built.args)
        out[method] = (loss, grads)
    for method in ("plain", "layer_stack"):
        loss, grads = out[method]
        want = models.convert(out["reversible"][1], method)
        rtol = tolerance(jnp.float32, "values")  # the same forward pass
        np.testing.assert_allclose(loss, out["reversible"][0], rtol=rtol)
        rtol = tolerance(jnp.float32)
        assert_trees_close(grads, want, rtol, f"{model} {method} gradient")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_hand_written_backward_equals_autodiff(dtype):
    """The overhead baseline itself, elementwise per leaf."""
    with jax.enable_x64(dtype == "float64"):
        sizes = overhead.Sizes(width=8, batch=4, depth=3)
        params, x = overhead.make_inputs(sizes, sizes.depth, dtype)
        want = jax.grad(overhead.loss_of("standard"), (0, 1))(params, x)
        for method in overhead.METHODS:
            got = jax.jit(overhead.grad_of(method))(params, x)
            assert_trees_close(got, want, tolerance(dtype), method)


# ----------------------------------------------------------------- slow tests


@pytest.mark.slow
def test_memory_tiny(tmp_path):
    mlp = tiny("memory", tmp_path)["models"]["mlp"]
    by = {(r["method"], r["depth"]): r for r in mlp["rows"]}
    depths = mlp["depths"]
    top = depths[-1]
    rev = [by["reversible", d]["temp_bytes"] for d in depths]
    std = [by["standard", d]["temp_bytes"] for d in depths]
    # The plot's claims: reversible flat, standard linear, checkpoint between.
    assert max(rev) <= 1.10 * min(rev), rev
    assert std[-1] >= 10 * rev[-1] and std[-1] / std[0] >= 0.5 * top / depths[0]
    assert rev[-1] < by["checkpoint", top]["temp_bytes"] < std[-1]
    assert by["checkpoint", top]["remat_calls_at_trace"] > 0
    # RevNet's 4/3, and the boundary check's reductions over the input, on by
    # default (at most 2% of a step: tests/core/test_boundary.py).
    assert by["reversible", top]["flops_ratio"] <= 1.34 * 1.02
    for key in ("temp_bytes", "flops"):  # generic @invertible = the sequence
        assert by["generic", top][key] <= 1.05 * by["reversible", top][key]
    for row in mlp["rows"]:
        assert row["best_plain"] in models.PLAIN_METHODS and row["median_s"] > 0
        lo, hi = row["time_vs_best_plain_min"], row["time_vs_best_plain_max"]
        assert lo <= row["time_vs_best_plain"] <= hi
        assert row["min_s"] <= row["median_s"] <= row["max_s"]
    assert "flops_ratio" not in by["plain", top]  # unrolled: not comparable
    # Per-block FLOPs of every method's unrolled twin (a remat'd plain chain
    # for layer_stack_remat), as --quick and the full run measure them.
    unrolled = mlp["unrolled_flops"]
    assert set(unrolled) == {
        "standard",
        "checkpoint",
        "reversible",
        "plain",
        "layer_stack_remat",
    }, unrolled
    assert unrolled["plain"] < unrolled["layer_stack_remat"], unrolled
    assert unrolled["standard"] < unrolled["reversible"], unrolled
    fits = mlp["budget"]
    assert fits["reversible"]["largest_depth"] > fits["standard"]["largest_depth"]
    assert os.path.getsize(tmp_path / "memory.png") > 10_000


@pytest.mark.slow
def test_speed_tiny(tmp_path):
    for row in tiny("speed", tmp_path)["rows"]:
        assert set(row["methods"]) == {"plain", "layer_stack", "reversible"}
        assert row["methods"][row["best_plain"]]["time_vs_best_plain"] == 1.0
        for stats in row["methods"].values():
            assert stats["median_s"] > 0 and stats["temp_bytes"] > 0


@pytest.mark.slow
def test_numerics_tiny(tmp_path):
    res = tiny("numerics", tmp_path)
    rows = res["rows"]
    assert {r["dtype"] for r in rows} == {"float32", "bfloat16", "float64"}
    f64 = [r for r in rows if r["dtype"] == "float64" and r["coupling"] == "additive"]
    worst = max(r["reconstruction_rel_error"] for r in f64)
    assert worst < tolerance("float64", "round_trip")
    f32 = [r for r in rows if r["dtype"] == "float32" and r["coupling"] == "additive"]
    assert max(r["grad_rel_error_reversible"] for r in f32) < 1e-4  # deep float32
    assert res["limits"]["additive"]["float64"]["all_measured_depths_ok"]
    for row in rows:
        for k, a in row["anchored"].items():
            # One reading per anchor, equal to the independently measured error.
            assert len(a["drift_readings"]) == -(-row["depth"] // int(k))
            np.testing.assert_allclose(
                a["drift_readings"],
                a["true_drift"],
                rtol=0.1,  # a drift estimate within 10%
                atol=1e-12,  # for readings near zero
            )
    deep = [r for r in f32 if r["depth"] == 16][0]
    assert deep["temp_vs_standard"] < deep["anchored"]["4"]["temp_vs_standard"] < 1


@pytest.mark.slow
def test_exact_tiny(tmp_path):
    res = tiny("exact", tmp_path)
    rows = {(r["mode"], r["depth"]): r for r in res["rows"]}
    depths = sorted({d for _, d in rows})
    assert len(depths) >= 2
    for depth in depths:
        # Exact mode rebuilds bit for bit at every depth; float32 does not.
        assert rows["exact", depth]["max_abs_error"] == 0.0
        assert rows["exact", depth]["bitwise_zero"] is True
        assert 0 < rows["plain", depth]["max_abs_error"] < 1e-3  # float32 drift
        assert rows["exact", depth]["output_max_abs"] < 2**14  # the exact range
    plain = [rows["plain", d]["max_abs_error"] for d in depths]
    assert plain[-1] > plain[0]  # float32 drifts with depth
    assert 0 < rows["anchored", depths[-1]]["max_abs_error"] <= plain[-1]
    cost = res["cost"]["coupling"]
    exact, inexact = cost["exact"], cost["inexact"]
    assert inexact["flops_per_layer"] > 0
    ratio = exact["flops_per_layer"] / inexact["flops_per_layer"]
    assert exact["flops_vs_inexact"] == pytest.approx(ratio)
    assert 1.0 <= ratio <= 1.10, ratio  # rounding adds a little, never a matmul
    assert exact["temp_bytes"] == inexact["temp_bytes"] > 0
    assert cost["standard backprop"]["temp_bytes"] > inexact["temp_bytes"]
    train = res["training"]
    for mode in ("float", "exact"):
        last = train[mode]["history"][-1]
        assert 0 <= last["test_accuracy"]["reversible"] <= 1
        assert np.isfinite(last["loss"]["reversible"])
        assert last["grad_max_abs_diff"] < 1e-5  # absolute, float32 training


@pytest.mark.slow
def test_loops_tiny(tmp_path):
    res = tiny("loops", tmp_path)
    temp = {(r["method"], r["steps"]): r["temp_bytes"] for r in res["sweep"]}
    lo, hi = 8, 64
    assert temp["revnet.while_loop", hi] <= 1.10 * temp["revnet.while_loop", lo]
    assert temp["lax.scan", hi] > 4 * temp["lax.scan", lo]
    evals = {
        (r["body"], r["method"], r["sweep"], r["max_steps"]): r["body_evaluations"]
        for r in res["comparison"]
    }
    # Inverting costs the steps taken, whatever max_steps; the scan runs them all.
    fixed = res["fixed_steps"]
    assert evals["invertible", "revnet", "max_steps", 256] == 2 * fixed
    assert evals["invertible", "checkpointed lax.scan", "max_steps", 256] == 2 * 256


@pytest.mark.slow
def test_overhead_tiny(tmp_path):
    res = tiny("overhead", tmp_path)
    assert res["gradient_check"]["passed"] is True
    # Fused backward: the same compiled cost as the hand-written custom_vjp.
    assert res["compiled"]["ratio"]["flops"] <= 1.03, res["compiled"]
    assert res["compiled"]["ratio"]["temp_bytes"] <= 1.05, res["compiled"]
    for method in overhead.METHODS:
        assert 1.1 <= res["compiled"]["flops_over_standard"][method] <= 1.45
        assert res["timings"][method]["first_call_s"]["median_s"] > 0
    assert res["eager_cache"]["jaxpr_prints_per_warm_eager_call"] == 0
    if res["eager_cache"]["analysis_count_available"]:
        assert res["eager_cache"]["analyses_per_warm_eager_call"] == 0
    for ratios in res["depth_scaling"]["deep_over_shallow"].values():
        assert ratios["temp_bytes"] <= 1.05


@pytest.mark.slow
def test_decisions_tiny(tmp_path):
    for row in tiny("decisions", tmp_path)["rows"]:
        assert row["error_store"] <= tolerance(jnp.float32), row
        assert row["temp_store"] >= row["temp_recompute"], row


@pytest.mark.slow
def test_sharding_tiny(tmp_path):
    rows = tiny("sharding", tmp_path)["rows"]
    temp = {(r["method"], r["mode"], r["depth"]): r["temp_bytes"] for r in rows}
    assert temp["reversible", "auto", 4] == temp["reversible", "auto", 8], temp


@pytest.mark.slow
def test_front_doors_tiny(tmp_path):
    doors = {d["door"]: d for d in tiny("front_doors", tmp_path)["doors"]}
    assert sorted(doors) == ["equinox", "haiku", "nnx"]
    for name, door in doors.items():
        by = {(r["depth"], r["method"]): r for r in door["rows"]}
        assert sorted({m for _, m in by}) == ["remat", "reversible", "standard"]
        (small, large) = sorted({d for d, _ in by})
        rev = {d: by[d, "reversible"]["temp_bytes"] for d in (small, large)}
        # Flat in depth (the stacked parameters' own slices aside), below the
        # standard twin's, and about one forward pass more, like remat.
        assert rev[large] <= 1.1 * rev[small], (name, rev)
        assert rev[large] < by[large, "standard"]["temp_bytes"], name
        flops = by[large, "reversible"]["flops"] / by[large, "remat"]["flops"]
        assert 0.9 < flops < 1.5, (name, flops)


@pytest.mark.slow
def test_flows_tiny_run_keeps_its_claims(tmp_path):
    """revnet's derived log-det equals flowjax's hand-written one on the same
    layers and parameters, and its memory does not grow with depth while
    flowjax's does."""
    results = tiny("flows", tmp_path)
    shallow, deep = results["rows"]
    for row in results["rows"]:
        assert row["log_det_max_abs"] > 0.1, row  # a flow that is not the identity
        for way in ("revnet", "jet-style"):
            rtol = tolerance(jnp.float32, "log_det")
            assert row[f"log_det_diff_{way}"] <= rtol * row["log_det_max_abs"], row
    assert deep["temp_revnet"] == shallow["temp_revnet"], results["rows"]
    assert deep["temp_flowjax"] > 2 * shallow["temp_flowjax"], results["rows"]
    assert deep["temp_revnet"] < deep["temp_jet-style"] < deep["temp_flowjax"]
    assert set(deep) >= {f"time_ratio_{w}" for w in ("flowjax", "revnet")}
    assert results["flowjax"]


@pytest.mark.parametrize("door", ["nnx", "equinox"])
def test_budget_door_steps_compile_abstract_and_run(door):
    """The budget's MLP steps of the NNX and Equinox doors (the tiny run takes
    Haiku's): planned without running, then run, each plan growing with the
    batch and the reversible one below remat's."""
    pytest.importorskip({"nnx": "flax", "equinox": "equinox"}[door])
    plans = {}
    for method in ("reversible", "remat"):
        spec = budget.spec_for("mlp", f"{door}/{method}", 2, 8, "tiny")
        plans[method] = [
            budget.plan_bytes({**spec, "batch": b})["temp_bytes"] for b in (8, 64)
        ]
        assert plans[method][1] > plans[method][0], plans
        fn, args = budget.step(spec)
        grads = jax.jit(fn)(*args)
        assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
    assert plans["reversible"][1] < plans["remat"][1], plans


@pytest.mark.slow
def test_budget_tiny_run_keeps_its_claims(tmp_path):
    """Each method's largest batch fits the budget and is what it says; the
    reversible stack fits more than ``layer_stack`` + remat; every method is
    timed at its own batch and at the baseline's; page faults are counted
    under both XLA settings; the tiny report leaves the timings out."""
    results = tiny("budget", tmp_path)
    assert results["timing_env"] == budget.PINNED
    for res in results["models"]:
        base = budget.baseline(res["model"])
        rev = "haiku/reversible" if res["model"] == "mlp" else "reversible"
        (b,) = res["budgets"]
        for method, fit in b["fits"].items():
            assert fit["batch"], (res["model"], method)
            assert fit["total_bytes"] <= b["budget_mib"] * budget.MIB, fit
            assert "median_s" in b["timed"][method], b["timed"]
            assert "median_s" in b["equal"][method], b["equal"]
        assert b["fits"][rev]["batch"] >= b["fits"][base]["batch"], b["fits"]
        assert b["equal_batch"] == b["fits"][base]["batch"]
        assert set(b["faults"]) == {"xla_default", "no_ynn"}
        for per in b["faults"].values():
            assert all(f["fault_bytes_per_step"] >= 0 for f in per.values()), per
        assert res["depths"][rev]["depth"] >= res["depths"][base]["depth"]
    text = budget.markdown(results, str(tmp_path))
    assert "single timings of toy steps are left out" in text
    # The batch tables: from each "Budget" line to its page-fault tables.
    tables = [part.split("Page faults")[0] for part in text.split("\nBudget ")[1:]]
    timing_rows = [
        ln
        for part in tables
        for ln in part.splitlines()
        if ln.startswith("| ") and not ln.startswith("| method")
    ]
    assert timing_rows and all(ln.endswith("| — | — | — |") for ln in timing_rows)


@pytest.mark.slow
def test_demo_tiny_report_states_its_sizes_and_embeds_its_plot(tmp_path):
    """``make demo``'s program at its tiny size: tqdm's bar on stderr counts
    its three parts to the end; the report says it is a tiny run, states its
    sizes, embeds the plot it wrote, keeps the smoke training and the timings
    out, and the memory it plots is flat for the reversible stack and linear
    for standard backprop."""
    proc = python("-m", "benchmarks.demo", "--tiny", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"demo: +0%\|.*\| 0/3 ", proc.stderr), proc.stderr[-3000:]
    assert re.search(r"demo: 100%\|.*\| 3/3 ", proc.stderr), proc.stderr[-3000:]
    with open(tmp_path / "demo.json") as f:
        results = json.load(f)
    text = (tmp_path / "REPORT.md").read_text()
    head = text.split("\n## ")[0]
    assert head.startswith("# revnet demo") and "**Tiny run (`--tiny`)" in head
    sizes = demo.SIZES["tiny"]
    assert f"width {sizes['width']}, batch {sizes['batch']}" in head
    assert "depths " + ", ".join(map(str, sizes["depths"])) in head
    assert f"![demo]({results['figure']})" in text
    assert os.path.getsize(tmp_path / results["figure"]) > 10_000
    assert "Smoke run, not a result" in text and "test acc." not in text
    assert results["time"] is None and "Left out of this tiny run" in text
    gap = max(r["grad_max_abs_diff"] for r in results["train"]["history"])
    assert f"**{gap:.2e}**" in text and gap < 1e-5  # absolute, float32 training
    by = {(r["method"], r["depth"]): r["temp_bytes"] for r in results["memory"]}
    lo, hi = sizes["depths"][0], sizes["depths"][-1]
    assert by["reversible", hi] <= 1.05 * by["reversible", lo]
    assert by["standard", hi] > 4 * by["standard", lo]
    assert by["reversible", hi] < by["checkpoint", hi] < by["standard", hi]


def test_demo_report_from_stored_results_states_sizes_and_time_medians():
    """The full-size demo report, from a synthetic result: sizes, the plot and
    the step time as a median of several timings, named as such."""
    sizes = demo.SIZES["demo"]
    memory_rows = [
        {
            "depth": d,
            "method": m,
            "temp_bytes": float(b * d if m != "reversible" else b),
        }
        | {"flops": 3.0, "temp_vs_standard": 1.0, "flops_vs_standard": 1.0}
        for d in sizes["depths"]
        for m, b in (("standard", 4e6), ("checkpoint", 2e6), ("reversible", 2e6))
    ]
    timed = {
        m: {"median_s": t, "min_s": t, "max_s": t, "vs_standard": t / 0.03}
        | {"vs_standard_min": 1.0, "vs_standard_max": 1.5}
        for m, t in (("standard", 0.03), ("checkpoint", 0.035), ("reversible", 0.04))
    }
    record = {"epoch": 1, "loss": {"reversible": 0.5, "standard": 0.5}}
    record |= {"test_accuracy": {"reversible": 0.9, "standard": 0.9}}
    record |= {"grad_max_abs_diff": 1e-7, "grad_max_abs": 0.1}
    config = {"smoke": False, "batch": 64, "lr": 0.05, "seed": 0, "epochs": 1}
    results = {
        "size": "demo",
        "sizes": sizes,
        "seconds": {"train": 1.0, "total": 2.0},
        "train": {"config": config, "history": [record], "temp_bytes": {}},
        "memory": memory_rows,
        "time": {"depth": 16, "repeats": sizes["repeats"], "methods": timed},
        "figure": "demo.png",
    }
    results["train"]["temp_bytes"] = {"reversible": 1.0, "standard": 2.0}
    text = demo.markdown(results, "unused")
    assert "Tiny run" not in text and "![demo](demo.png)" in text
    assert f"median of {sizes['repeats']} timings" in text
    assert "| reversible (revnet) | 40 |" in text
    assert "test acc. reversible" in text


def test_budget_refuses_a_gpu_run_without_a_gpu_and_bad_budgets():
    """``--device gpu`` on a CPU-only JAX ends at once with one line naming
    the backend; ``--budgets`` takes positive MiB only."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "REVNET_RUNTIME_CHECKS": "0"}
    for argv, want in (
        (["--device", "gpu"], "--device gpu: JAX's default backend is cpu"),
        (["--budgets", "64,0"], "not positive MiB: '64,0'"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.budget", *argv],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 2, proc.stderr
        assert want in proc.stderr.strip().splitlines()[-1], proc.stderr
    assert budget._budgets("64,256") == (64, 256)


@pytest.mark.slow
def test_simulation_tiny(tmp_path):
    """Each peer's step, inverted: flat memory in the steps, under the peer's
    own method's, and its gradient."""
    for package in ("jax_md", "diffrax", "fdtdx"):
        pytest.importorskip(package, reason="the simulation extra")
    res = tiny("simulation", tmp_path)
    assert "missing" not in res, res["missing"]
    temp = {(r["workload"], r["method"], r["steps"]): r for r in res["rows"]}
    lo, hi = res["steps"]
    for workload, peer in (
        ("jax-md", "checkpoint"),
        ("diffrax", "diffrax"),
        ("fdtdx", "checkpoint"),
    ):
        revnet_hi = temp[workload, "revnet", hi]["temp_bytes"]
        assert revnet_hi == temp[workload, "revnet", lo]["temp_bytes"], workload
        assert revnet_hi < temp[workload, peer, hi]["temp_bytes"], workload
        # float32 simulations over many steps: far looser than the table's
        assert temp[workload, "revnet", hi]["grad_rel_error"] < 1e-3, workload
