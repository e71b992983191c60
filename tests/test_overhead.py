"""The overhead benchmark (``python -m experiments.overhead``) in --tiny mode.

The benchmark runs in-process (it turns run-time checks off while it measures
and restores the setting). The test reads back what it wrote: the files, the
keys the report needs, the gradient check against plain ``jax.grad``, and the
compiled cost of ``@invertible`` against the hand-written ``jax.custom_vjp``.
Wall times are recorded but never asserted on.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import pytest

from experiments import overhead
from tests.helpers import RTOL, assert_trees_close

# Both programs run the same forward stack and ONE reverse scan that rebuilds
# each block with one evaluation of F and G, fused with their VJPs. Measured
# (CPU, tiny/quick/full sizes): FLOPs and temp memory ratios 1.000. An
# unfused inverse (F and G evaluated again for the VJP) costs 1.42/1.33 = 1.07x
# the FLOPs, and saving a block's activations at least doubles temp memory, so
# these bounds separate the fused design from both regressions.
FLOPS_BOUND = 1.03
TEMP_BOUND = 1.05


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("overhead")
    # One timed round: the figures are not asserted on, only recorded.
    flags = ["--tiny", "--repeats", "1", "--eager-calls", "1"]
    assert overhead.main([*flags, "--out", str(out)]) == 0
    with open(out / "overhead.json") as f:
        data = json.load(f)
    with open(out / "overhead.md") as f:
        data["_markdown"] = f.read()
    return data


def test_files_and_keys(result):
    for key in ("machine", "config", "command", "time_utc", "device"):
        assert key in result
    for method in overhead.METHODS:
        times = result["timings"][method]
        for key in (
            "trace_s",
            "first_call_s",
            "lower_s",
            "compile_s",
            "jit_grad_s",
            "eager_forward_s",
            "eager_grad_s",
        ):
            assert times[key]["median_s"] > 0, (method, key)
            assert key in result["time_ratio"]
        for key in ("temp_bytes", "flops"):
            assert result["compiled"][method][key] > 0
    depths = result["depth_scaling"]["depths"]
    assert depths == [4, 32]
    assert {(r["depth"], r["method"]) for r in result["depth_scaling"]["rows"]} == {
        (d, m) for d in depths for m in overhead.METHODS
    }
    eager = result["eager_cache"]
    assert eager["calls"] > 0
    assert eager["analysis_count_available"] == (
        eager["analyses_per_warm_eager_call"] is not None
    )
    assert "| warm eager `grad` |" in result["_markdown"]


def test_gradient_check_ran_and_passed(result):
    check = result["gradient_check"]
    assert check["passed"] is True
    for dtype in ("float32", "float64"):
        assert check[dtype]["passed"] is True
        for method in overhead.METHODS:
            errs = check[dtype][method]
            assert 0 <= errs["grad_rel_error"] <= check[dtype]["rtol"]
            assert 0 <= errs["value_rel_error"] <= check[dtype]["rtol"]


def test_compiled_cost_matches_hand_written(result):
    ratio = result["compiled"]["ratio"]
    assert ratio["flops"] <= FLOPS_BOUND, result["compiled"]
    assert ratio["temp_bytes"] <= TEMP_BOUND, result["compiled"]
    # Both cost about 4/3 of plain backprop (the scan body is counted once).
    for method in overhead.METHODS:
        assert 1.1 <= result["compiled"]["flops_over_standard"][method] <= 1.45


def test_warm_eager_calls_do_not_reprint_jaxprs(result):
    eager = result["eager_cache"]
    assert eager["jaxpr_prints_per_warm_eager_call"] == 0
    if eager["analysis_count_available"]:
        assert eager["analyses_per_warm_eager_call"] == 0


def test_depth_does_not_grow_memory(result):
    for ratios in result["depth_scaling"]["deep_over_shallow"].values():
        assert ratios["temp_bytes"] <= 1.05


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_hand_written_backward_equals_autodiff(dtype):
    """The baseline itself, elementwise per leaf (the benchmark's own check is
    a max over leaves)."""
    with jax.enable_x64(dtype == "float64"):
        args = overhead.build_parser().parse_args(["--out", "."])
        args.width, args.batch, args.depth = 8, 4, 3
        params, x = overhead.make_inputs(args, args.depth, dtype)
        want = jax.grad(overhead.loss_of("standard"), (0, 1))(params, x)
        for method in overhead.METHODS:
            got = jax.jit(overhead.grad_of(method))(params, x)
            assert_trees_close(got, want, RTOL[jnp.dtype(dtype)], method)


def test_bad_flags_exit_with_one_line(capsys, tmp_path):
    with pytest.raises(SystemExit) as err:
        overhead.main(["--depths", "8,8", "--out", str(tmp_path)])
    assert err.value.code == 2
    message = capsys.readouterr().err.strip()
    assert len(message.splitlines()) == 1 and "--depths" in message
    assert not os.path.exists(tmp_path / "overhead.json")
