"""End-to-end tests of the experiment scripts (their --tiny paths).

Each script runs in a subprocess exactly as a user runs it, and the test reads
back the JSON it wrote: the fields the report needs must be there, and the
claims the plots make must hold for the measured numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(name: str, *flags: str, env: dict[str, str] | None = None):
    """Runs ``python -m experiments.NAME flags`` and returns the process."""
    return subprocess.run(
        [sys.executable, "-m", f"experiments.{name}", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        # The experiments measure the default configuration (checks off).
        env={**os.environ, "REVNET_RUNTIME_CHECKS": "0", **(env or {})},
    )


def run_ok(name: str, out, *flags: str, env: dict[str, str] | None = None) -> dict:
    proc = run_script(name, "--tiny", "--out", str(out), *flags, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(out, f"{name}.json")) as f:
        result = json.load(f)
    assert os.path.getsize(os.path.join(out, f"{name}.png")) > 10_000
    for key in ("machine", "config", "command", "time_utc"):
        assert key in result
    assert result["machine"]["jax"]
    return result


def report_text(out) -> str:
    from experiments import report

    with open(report.write_report(str(out))) as f:
        return f.read()


def test_memory_tiny(tmp_path):
    res = run_ok("memory", tmp_path)
    mlp = res["models"]["mlp"]
    rows = mlp["rows"]
    assert {r["method"] for r in rows} == {
        "standard",
        "checkpoint",
        "reversible",
        "generic",
        "plain",
        "layer_stack",
    }
    for row in rows:
        for key in (
            "temp_bytes",
            "flops",
            "temp_ratio",
            "flops_ratio",
            "median_s",
            "time_vs_best_plain",
            "temp_vs_best_plain",
        ):
            assert key in row and row[key] is not None, (key, row)
        assert row["best_plain"] in ("plain", "layer_stack")
    by = {(r["method"], r["depth"]): r for r in rows}
    depths = sorted(mlp["depths"])
    top = depths[-1]
    rev = [by["reversible", d]["temp_bytes"] for d in depths]
    std = [by["standard", d]["temp_bytes"] for d in depths]
    ckpt = [by["checkpoint", d]["temp_bytes"] for d in depths]
    # The plot's claims: reversible flat, standard linear, checkpoint between.
    assert max(rev) <= 1.10 * min(rev), rev
    assert std[-1] >= 10 * by["reversible", top]["temp_bytes"], (std, rev)
    assert std[-1] / std[0] >= 0.5 * top / depths[0]
    assert rev[-1] < ckpt[-1] < std[-1]
    # The checkpoint baseline really rematerialises the couplings.
    assert by["checkpoint", top]["remat_calls_at_trace"] > 0
    # Fused backward: RevNet's 4/3 of backprop (the transformer's is in
    # tests/blocks/test_cost.py).
    assert by["reversible", top]["flops_ratio"] <= 1.34
    summary = res["summary"]["mlp"]
    assert summary["standard_over_reversible_temp"] >= 10
    # The generic @invertible path costs what the hand-built sequence costs.
    assert summary["generic_over_sequence"]["temp"] <= 1.05, summary
    assert summary["generic_over_sequence"]["flops"] <= 1.05, summary
    fits = mlp["budget"]["methods"]
    assert (
        fits["reversible"]["largest_depth"]["largest"]
        > fits["standard"]["largest_depth"]["largest"]
    )
    text = report_text(tmp_path)
    assert "![memory](memory.png)" in text and "| depth | method |" in text


def test_speed_tiny(tmp_path):
    proc = run_script("speed", "--tiny", "--models", "conv,mlp", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "speed.json") as f:
        res = json.load(f)
    assert res["machine"]["backend"] and res["config"]["runtime_checks"] is False
    assert [(r["model"], r["depth"]) for r in res["rows"]] == [("conv", 2), ("mlp", 2)]
    for row in res["rows"]:
        assert set(row["methods"]) == {"plain", "layer_stack", "reversible"}
        best = row["methods"][row["best_plain"]]
        assert best["time_vs_best_plain"] == 1.0
        for stats in row["methods"].values():
            assert stats["median_s"] > 0 and stats["temp_bytes"] > 0
            assert stats["time_vs_best_plain"] >= 1.0 or stats is not best
    text = report_text(tmp_path)
    assert "## Step time against plain Haiku" in text and "Platform: cpu" in text


@pytest.mark.parametrize("model", ["conv", "transformer"])
def test_plain_baselines_train_the_same_parameters(model):
    """plain, layer_stack and reversible runs of one model give the same loss
    and gradients, leaf by leaf, once the trees are put in one layout."""
    import jax

    from experiments import baselines, models
    from tests.helpers import assert_trees_close

    sizes = {
        "conv": {"image_size": 8, "batch": 2, "channels": 8},
        "transformer": {**models.default_sizes("transformer", True), "seq_len": 8},
    }[model]
    out, init = {}, None
    for method in ("reversible", "plain", "layer_stack"):
        spec = {"model": model, "method": method, "depth": 2, **sizes}
        built = models.build(spec, init=init)
        init = built.init
        loss, grads, _ = jax.jit(built.grad_step)(*built.args)
        out[method] = (loss, grads)
    for method in ("plain", "layer_stack"):
        loss, grads = out[method]
        want = baselines.convert(out["reversible"][1], method)
        np.testing.assert_allclose(loss, out["reversible"][0], rtol=1e-6)
        assert_trees_close(grads, want, 1e-5, f"{model} {method} gradient")


def test_numerics_tiny(tmp_path):
    res = run_ok("numerics", tmp_path)
    rows = res["rows"]
    assert {r["dtype"] for r in rows} == {"float32", "bfloat16", "float64"}
    for row in rows:
        for key in (
            "reconstruction_rel_error",
            "grad_rel_error_reversible",
            "grad_rel_error_standard",
        ):
            assert key in row
    assert {r["coupling"] for r in rows} == {"additive", "affine_default"}
    f64 = [r for r in rows if r["dtype"] == "float64" and r["coupling"] == "additive"]
    assert max(r["reconstruction_rel_error"] for r in f64) < 1e-10
    f32 = [r for r in rows if r["dtype"] == "float32" and r["coupling"] == "additive"]
    assert max(r["grad_rel_error_reversible"] for r in f32) < 1e-4
    assert res["limits"]["additive"]["float64"]["all_measured_depths_ok"]
    for row in rows:
        assert sorted(row["anchored"]) == ["16", "4"]
        float32 = row["dtype"] == "float32"
        assert (row["temp_vs_standard"] is not None) == float32
        for k, a in row["anchored"].items():
            # One reading per anchor, equal to the independently measured error.
            assert len(a["drift_readings"]) == -(-row["depth"] // int(k))
            np.testing.assert_allclose(
                a["drift_readings"], a["true_drift"], rtol=0.1, atol=1e-12
            )
            assert (a["temp_vs_standard"] is not None) == float32
    deep = [r for r in f32 if r["depth"] == 16]
    # Anchors every 4 layers hold more than none and less than backprop.
    assert deep[0]["temp_vs_standard"] < deep[0]["anchored"]["4"]["temp_vs_standard"]
    assert deep[0]["anchored"]["4"]["temp_vs_standard"] < 1
    assert "![numerics](numerics.png)" in report_text(tmp_path)


TRAIN_EPOCHS = "6"  # the tiny config reaches >= 95% test accuracy in 6 epochs


@pytest.fixture(scope="module")
def single_device_run(tmp_path_factory):
    """A tiny training run interrupted after one epoch, then resumed."""
    out = tmp_path_factory.mktemp("train1")
    flags = ("--epochs", TRAIN_EPOCHS)
    first = run_ok("train", out, *flags, "--stop-after", "1", "--save-grads")
    second = run_ok("train", out, *flags)
    return out, first, second


def test_train_resumes_and_twins_agree(single_device_run):
    out, first, second = single_device_run
    assert not first["finished"] and first["epochs_done"] == 1
    assert second["finished"] and second["resumed_from_epoch"] == 1
    steps = second["steps_per_epoch"]
    assert len(second["history"]["step"]) == int(TRAIN_EPOCHS) * steps
    # The resumed run continues the first run's curve, not a new one.
    for twin in ("reversible", "standard"):
        assert second["history"]["loss"][twin][:steps] == first["history"]["loss"][twin]
    # The must-hold, measured in lock-step: at every step the standard twin's
    # loss and gradients on the reversible twin's parameters and state.
    hist = second["history"]
    lock = np.abs(
        np.subtract(hist["loss"]["reversible"], hist["lockstep"]["loss_standard"])
    )
    assert lock.size == int(TRAIN_EPOCHS) * steps
    assert lock.max() < 1e-3, lock.max()
    assert second["lockstep"]["loss_max_abs_diff"] == pytest.approx(lock.max())
    # Gradients: float32 rounding at a typical step; rare steps differ more
    # (quick runs showed isolated 2e-4..4e-4, plausibly a reconstructed
    # pre-activation crossing a ReLU kink), so the bound on the worst step is
    # the gross-error one.
    assert np.median(hist["lockstep"]["grad_rel_diff"]) < 1e-5
    assert max(hist["lockstep"]["grad_rel_diff"]) < 1e-2
    for twin in ("reversible", "standard"):
        assert second["test_accuracy"][twin] >= 0.95, second["test_accuracy"]
    # Free-running twins: float32 noise stays tiny during the warm-up epoch;
    # later the training dynamics amplify it, as they amplify a 1e-7 relative
    # perturbation of the standard twin's own parameters (the control).
    diff = np.abs(
        np.subtract(
            hist["loss"]["reversible"][:steps], hist["loss"]["standard"][:steps]
        )
    )
    assert diff.max() < 1e-3
    assert "first_step_over_1e-3" in second
    control = second["control"]
    assert len(hist["control_loss"]) == len(hist["step"])
    assert control["relative_perturbation"] == 1e-7
    assert control["loss_max_abs_diff"] is not None
    grads = np.load(os.path.join(out, "train_grads.npz"))
    scale = max(float(np.abs(grads[k]).max()) for k in grads.files)
    for k in grads.files:
        if k.startswith("reversible/"):
            other = grads["standard/" + k[len("reversible/") :]]
            np.testing.assert_allclose(grads[k], other, atol=1e-5 * scale, err_msg=k)
    for key in ("test_accuracy", "step_time", "compiled_step_memory"):
        assert set(second[key]) >= {"reversible", "standard"}
    ratio = second["step_time"]["ratio_reversible_over_standard"]
    assert ratio["min"] <= ratio["median"] <= ratio["max"]
    rev = second["compiled_step_memory"]["reversible"]["temp_bytes"]
    assert rev < second["compiled_step_memory"]["standard"]["temp_bytes"]
    assert "![train](train.png)" in report_text(out)


def test_train_data_parallel_matches_single_device(single_device_run, tmp_path):
    out, _, single = single_device_run
    flags = "--xla_force_host_platform_device_count=8"
    # Same schedule as the single-device run; one epoch (the warm-up), after
    # which the training dynamics amplify float32 noise in either run. The
    # 8-device reversible twin also stores anchors (every unit): they change
    # nothing but rounding.
    multi = run_ok(
        "train",
        tmp_path,
        *("--epochs", TRAIN_EPOCHS, "--stop-after", "1", "--save-grads"),
        *("--anchor-every", "1"),
        env={"XLA_FLAGS": flags},
    )
    assert multi["num_devices"] == 8 and single["num_devices"] == 1
    assert multi["config"]["anchor_every"] == 1
    steps = multi["steps_per_epoch"]
    for twin in ("reversible", "standard"):
        np.testing.assert_allclose(
            multi["history"]["loss"][twin],
            single["history"]["loss"][twin][:steps],
            rtol=0,
            atol=1e-4,
        )
    g1 = np.load(os.path.join(out, "train_grads.npz"))
    g8 = np.load(os.path.join(tmp_path, "train_grads.npz"))
    assert sorted(g1.files) == sorted(g8.files)
    scale = max(float(np.abs(g1[k]).max()) for k in g1.files)
    for k in g1.files:
        np.testing.assert_allclose(g8[k], g1[k], rtol=0, atol=1e-5 * scale, err_msg=k)


@pytest.mark.parametrize(
    "name, flags",
    [
        ("memory", ["--depths", "4,-3"]),
        ("memory", ["--models", "resnet"]),
        ("memory", ["--budget-mib", "0"]),
        ("train", ["--epochs", "0"]),
        ("numerics", ["--dtypes", "float16"]),
        ("demo", ["--only", "nothing"]),
    ],
)
def test_bad_flags_give_one_line_error(name, flags, tmp_path):
    proc = run_script(name, "--out", str(tmp_path), *flags)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].count("error:") == 1


@pytest.mark.parametrize("name", ["memory", "train", "numerics"])
def test_unwritable_output_folder(name, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    proc = run_script(name, "--tiny", "--out", str(blocker / "results"))
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert "not writable" in proc.stderr.strip().splitlines()[-1]


def test_help_runs():
    for name in ("memory", "speed", "train", "numerics", "demo"):
        proc = run_script(name, "--help")
        assert proc.returncode == 0 and "--out" in proc.stdout


@pytest.mark.parametrize(
    "name, flags, env",
    [
        ("train", ["--width", "3"], None),  # the coupling splits the width in two
        ("train", ["--batch", "5000"], None),  # digits: 1437 training images
        ("train", ["--batch", "1438"], None),
        ("train", ["--seed", "-1"], None),
        ("train", ["--units", "2,0"], None),
        # The batch is split over the devices.
        (
            "train",
            ["--batch", "60"],
            {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
        ),
        ("numerics", ["--width", "7"], None),
        ("numerics", ["--depths", "0"], None),
        ("memory", ["--depths", "0"], None),
        ("memory", ["--batch", "-2"], None),
        ("loops", ["--seed", "-1"], None),
        ("loops", ["--t-min", "5"], None),
        ("loops", ["--steps", "4,0"], None),
        ("demo", ["--only", "train,nothing"], None),
    ],
)
def test_bad_values_give_one_line_and_exit_2(name, flags, env, tmp_path):
    """A bad flag value is ONE line on stderr naming the flag, the value and
    what is expected; the exit status is argparse's 2; no traceback."""
    proc = run_script(name, "--out", str(tmp_path), *flags, env=env)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert len(lines) == 1, lines
    assert "error:" in lines[0] and f"argument {flags[0]}:" in lines[0], lines
    assert "expected" in lines[0] or "choose from" in lines[0], lines
    value = flags[1].split(",")[-1]
    assert value in lines[0], lines


def test_loops_report_has_one_compact_comparison_table(tmp_path):
    """Rendering only: rows shaped like experiments.loops' comparison."""
    from experiments import report

    methods = ["revnet", "revnet checkpoint", "checkpointed lax.scan", "unrolled"]
    rows = []
    for b, body in enumerate(["invertible", "not invertible"]):
        for k, method in enumerate(methods):
            points = [("steps", n, n) for n in (16, 64)]
            points += [("max_steps", 16, m) for m in (64, 256)]
            for sweep, n, m in points:
                if method == "unrolled" and n == 64:
                    continue  # unrolled only where it fits
                rows.append(
                    dict(
                        body=body,
                        method=method,
                        sweep=sweep,
                        steps=n,
                        max_steps=m,
                        temp_bytes=float((b + 1) * (k + 1) * m * 2**20 / 64),
                        body_evaluations=2 * n + k,
                        median_s=0.001 * (k + 1),
                    )
                )
    res = {"experiment": "loops", "config": {"seed": 0}, "comparison": rows}
    text = report.loops_section(res, str(tmp_path))
    first = text[text.index("| body |") :].split("\n\n")[0]
    table = [line for line in first.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + 2 * 4  # header, then body x method
    assert "temp MiB, n = 16 / 64" in table[0]
    assert "body evaluations, n = 16, max_steps 64 / 256" in table[0]
    # The checkpointed scan is the time baseline; unrolled has no 64-step point.
    scan = next(line for line in table if "`jax.checkpoint`" in line)
    assert scan.split("|")[-2].strip() == "1"
    unrolled = next(line for line in table if "unrolled" in line)
    assert "35 / —" in unrolled  # 2 * 16 + 3 evaluations at n = 16
    assert "**config**" in text
