"""At a fixed memory budget: the largest batch, its throughput, the largest depth.

RevViT's question: at the memory I have, how fast do I train? For a
transformer and a conv net (Haiku, :mod:`benchmarks.models`) and an MLP
coupling stack written in each front door (:mod:`benchmarks.front_doors`), at
one depth and memory budget, per method:

* the **largest batch** whose compiled step fits the budget, found by
  compiling (abstract arguments: nothing runs). The budget holds what XLA
  allocates for one step: arguments + outputs + temp (``memory_analysis``);
* the **examples/s** at that batch;
* the **step time at equal batch**: every method at the batch that
  ``layer_stack`` + remat (JAX's best same-FLOP baseline) fits;
* the **largest depth** at a fixed small batch;
* **page faults** and **peak resident memory** of a step at that batch, since
  the plan misses buffers that XLA:CPU's library fusions allocate with
  ``malloc`` (see "CPU settings" in ``docs/guides/performance.md``).

Methods: for the Haiku models ``reversible``, ``standard``, ``checkpoint``
(per-block ``hk.remat``) and ``layer_stack_remat``; for the MLP, each door's
``reversible``, ``remat`` (its framework's scan + remat) and ``standard``.

Timings run in fresh worker processes with glibc's ``malloc`` thresholds
pinned (:data:`PINNED`), so they do not depend on what ran earlier in a
process; one worker times all methods of one comparison in interleaved rounds
and reports medians. Page faults are measured per method in fresh workers with
the default allocator, under XLA's default CPU fusions and with its YNN
fusions off (:data:`NO_YNN`). ``--device gpu`` measures on the GPU.

    python -m benchmarks.budget [--quick | --tiny] [--out results] [--device gpu]
        [--models transformer,mlp,conv] [--budgets 64,256]

On a GPU (``--device gpu``, JAX's default backend must be CUDA) the full size
uses budgets of 256 MiB and 1 GiB, since a GPU fits far larger batches.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

NAME = "budget"
MIB = 2**20
# glibc keeps freed memory instead of returning and re-faulting it.
PINNED = {"MALLOC_MMAP_THRESHOLD_": str(2**30), "MALLOC_TRIM_THRESHOLD_": str(2**32)}
# XLA:CPU without its YNN library fusions, whose intermediates live outside
# the compiled plan.
NO_YNN = {"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type="}
HAIKU_METHODS = ("reversible", "layer_stack_remat", "checkpoint", "standard")
BASELINE = {"haiku": "layer_stack_remat", "door": "haiku/remat"}
SIZES: dict[str, dict[str, Any]] = {
    "full": {
        "models": ("transformer", "mlp", "conv"),
        "depth": 32,
        "budgets_mib": (64, 256),
        "depth_batch": 8,
        "depth_cap": 4096,
        "batch_cap": 1 << 16,
        "repeats": 5,
    },
    "quick": {
        "models": ("transformer", "mlp", "conv"),
        "depth": 16,
        "budgets_mib": (64,),
        "depth_batch": 8,
        "depth_cap": 1024,
        "batch_cap": 1 << 16,
        "repeats": 3,
    },
    # --device gpu: a GPU fits batches far beyond a CPU's, and only a bigger
    # batch raises its utilisation, so the budgets are larger.
    "gpu": {
        "models": ("transformer", "mlp", "conv"),
        "depth": 32,
        "budgets_mib": (256, 1024),
        "depth_batch": 8,
        "depth_cap": 4096,
        "batch_cap": 1 << 18,
        "repeats": 7,
    },
    "tiny": {
        "models": ("transformer", "mlp"),
        "depth": 4,
        "budgets_mib": (24,),
        "depth_batch": 2,
        "depth_cap": 16,
        "batch_cap": 512,
        "repeats": 1,
        "only": ("reversible", "layer_stack_remat", "haiku/reversible", "haiku/remat"),
    },
}
TINY_SIZES = {
    "transformer": {"seq_len": 16, "model_size": 32, "mlp_size": 64},
}


def methods(model: str) -> tuple[str, ...]:
    """The methods measured on ``model``."""
    if model == "mlp":
        return tuple(f"{d}/{m}" for d in _doors() for m in _DOOR_METHODS)
    return HAIKU_METHODS


def baseline(model: str) -> str:
    """The method the others are compared with: JAX's best same-FLOP one."""
    return BASELINE["door" if model == "mlp" else "haiku"]


_DOOR_METHODS = ("reversible", "remat", "standard")


def _doors() -> list[str]:
    import importlib.util

    from benchmarks import front_doors

    return [
        door
        for door, (package, _) in front_doors.BUILDERS.items()
        if importlib.util.find_spec(package) is not None
    ]


# Building one step ----------------------------------------------------------


def _haiku_step(spec: dict[str, Any], abstract: bool):
    from benchmarks import models

    built = models.build(spec, abstract=abstract)
    return built.grad_step, built.args


def _door_step(spec: dict[str, Any], abstract: bool):
    import jax

    from benchmarks import front_doors

    door, method = spec["method"].split("/")
    build = front_doors.BUILDERS[door][1]
    grads: list[Any] = []

    def make(x1):  # the parameters do not depend on the batch
        grad, (params, _) = build(spec["depth"], x1)[method]
        grads.append(grad)
        return params

    small = jax.numpy.zeros((1, front_doors.WIDTH))
    shape = (spec["batch"], front_doors.WIDTH)
    if abstract:
        params = jax.eval_shape(make, small)
        x = jax.ShapeDtypeStruct(shape, jax.numpy.float32)
    else:
        params = make(small)
        x = jax.random.normal(jax.random.key(1), shape)

    def fn(*args, grad=grads[-1]):
        return grad(*args)

    return fn, (params, x)


def step(spec: dict[str, Any], abstract: bool = False):
    """``(fn, args)`` of one training gradient step of ``spec``."""
    if spec["model"] == "mlp":
        return _door_step(spec, abstract)
    return _haiku_step(spec, abstract)


def plan_bytes(spec: dict[str, Any]) -> dict[str, int]:
    """Arguments, outputs and temp of the compiled step (nothing runs)."""
    import jax

    fn, args = step(spec, abstract=True)
    m = jax.jit(fn).lower(*args).compile().memory_analysis()
    out = {
        "argument_bytes": int(m.argument_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
        "temp_bytes": int(m.temp_size_in_bytes),
    }
    out["total_bytes"] = sum(out.values())
    return out


def spec_for(model: str, method: str, depth: int, batch: int, size: str) -> dict:
    """One configuration (see :mod:`benchmarks.models`)."""
    from benchmarks import models

    sizes = {} if model == "mlp" else models.default_sizes(model, quick=True)
    if size == "tiny":
        sizes.update(TINY_SIZES.get(model, {}))
    return {**sizes, "model": model, "method": method, "depth": depth, "batch": batch}


# The worker: a fresh process per timing or fault measurement ----------------


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def worker(job: dict[str, Any]) -> dict[str, Any]:
    """Times ``job["specs"]`` in interleaved rounds, or counts one's faults."""
    import jax

    from benchmarks import measure

    compiled, stats = {}, {}
    for name, spec in job["specs"].items():
        fn, args = step(spec)
        exe, stats[name] = measure.compile_stats(fn, *args)
        compiled[name] = (lambda exe=exe, args=args: exe(*args), args)
    if job["kind"] == "time":
        fns = {name: c for name, (c, _) in compiled.items()}
        times = measure.median_times(fns, int(job["repeats"]))
        return {n: {**stats[n], **times[n]} for n in fns}
    ((name, (run, _)),) = compiled.items()
    for _ in range(2):
        jax.block_until_ready(run())
    reset = measure.reset_peak_rss()
    before = measure.rss_mib("VmRSS")
    per_step = []
    for _ in range(int(job["steps"])):
        f0 = _faults()
        jax.block_until_ready(run())
        per_step.append(_faults() - f0)
    hwm = measure.rss_mib("VmHWM") if reset else None
    page = os.sysconf("SC_PAGE_SIZE")
    out = {
        **stats[name],
        "fault_bytes_per_step": statistics.median(per_step) * page,
        "step_rss_increase_mib": None if hwm is None else hwm - before,
    }
    return {name: out}


# The driver -----------------------------------------------------------------


def _run(job: dict[str, Any], env: dict[str, str], device: str) -> dict[str, Any]:
    from benchmarks import measure

    if device == "cpu":
        env = {"JAX_PLATFORMS": "cpu", **env}
    return measure.run_worker("benchmarks.budget", job, env, timeout=3600)


def largest(model, method, depth, batch, size, budget, axis, cap) -> dict[str, Any]:
    """The largest batch (``axis="batch"``) or depth fitting ``budget`` bytes."""
    from benchmarks.memory import largest_fitting

    seen: dict[int, dict[str, int]] = {}

    def total(n: int) -> float:
        d, b = (depth, n) if axis == "batch" else (n, batch)
        seen[n] = plan_bytes(spec_for(model, method, d, b, size))
        return seen[n]["total_bytes"]

    guess = 8
    n, probes = largest_fitting(total, budget, guess, cap)
    return {axis: n, "probes": probes, **(seen.get(n) or {})}


def measure_model(
    model: str, size: str, device: str, budgets_mib: Sequence[int] | None = None
) -> dict[str, Any]:
    """Every figure of one model (see the module docstring)."""
    cfg = dict(SIZES[size])
    if budgets_mib:
        cfg["budgets_mib"] = tuple(budgets_mib)
    depth, names, base = cfg["depth"], methods(model), baseline(model)
    names = tuple(m for m in names if m in cfg.get("only", names))
    env = PINNED if device == "cpu" else {}
    result: dict[str, Any] = {"model": model, "depth": depth, "budgets": []}
    sizes = spec_for(model, base, depth, 0, size)
    result["sizes"] = {k: v for k, v in sizes.items() if k not in ("method", "batch")}
    for budget_mib in cfg["budgets_mib"]:
        budget = budget_mib * MIB
        fits = {
            m: largest(model, m, depth, None, size, budget, "batch", cfg["batch_cap"])
            for m in names
        }
        print(
            f"[budget] {model} {budget_mib} MiB: "
            f"{ {m: f['batch'] for m, f in fits.items()} }",
            flush=True,
        )
        own = {
            m: spec_for(model, m, depth, f["batch"], size)
            for m, f in fits.items()
            if f["batch"]
        }
        timed = _run(
            {"kind": "time", "specs": own, "repeats": cfg["repeats"]}, env, device
        )
        equal_batch = fits[base]["batch"]
        equal = {}
        if equal_batch:
            specs = {m: spec_for(model, m, depth, equal_batch, size) for m in names}
            equal = _run(
                {"kind": "time", "specs": specs, "repeats": cfg["repeats"]}, env, device
            )
        faults = {}
        if device == "cpu" and budget_mib == max(cfg["budgets_mib"]):
            for setting, fenv in (("xla_default", {}), ("no_ynn", NO_YNN)):
                faults[setting] = {}
                for m, spec in own.items():
                    got = _run(
                        {"kind": "faults", "specs": {m: spec}, "steps": 3}, fenv, device
                    )
                    faults[setting][m] = got.get(m, got)
        result["budgets"].append(
            {
                "budget_mib": budget_mib,
                "fits": fits,
                "timed": timed,
                "equal_batch": equal_batch,
                "equal": equal,
                "faults": faults,
            }
        )
    small = min(cfg["budgets_mib"]) * MIB
    result["depth_batch"] = cfg["depth_batch"]
    result["depths"] = {
        m: largest(
            model, m, None, cfg["depth_batch"], size, small, "depth", cfg["depth_cap"]
        )
        for m in names
    }
    return result


def _require_gpu() -> None:
    import jax

    if jax.default_backend() != "gpu":
        print(
            f"--device gpu: JAX's default backend is {jax.default_backend()}; "
            "install JAX with CUDA, or leave --device out",
            file=sys.stderr,
        )
        sys.exit(2)


def _budgets(text: str) -> tuple[int, ...]:
    import argparse

    try:
        got = tuple(int(n) for n in text.split(",") if n)
    except ValueError:
        got = ()
    if not got or min(got) <= 0:
        raise argparse.ArgumentTypeError(f"not positive MiB: {text!r}")
    return got


def main(argv: Sequence[str] | None = None) -> dict:
    """Measures every model; writes ``<out>/budget.json``."""
    from benchmarks import measure

    def add(parser):
        parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
        parser.add_argument(
            "--models",
            type=measure.names_of(SIZES["full"]["models"]),
            default=None,
            help="a,b of transformer,mlp,conv",
        )
        parser.add_argument(
            "--budgets", type=_budgets, default=None, help="MiB,MiB (the size's)"
        )

    args = measure.parse(__doc__, argv, add)
    if args.device == "gpu":
        _require_gpu()
        if args.size == "full":
            args.size = "gpu"
    results = {
        "size": args.size,
        "device": args.device,
        "budget_counts": "arguments + outputs + temp of the compiled step",
        "timing_env": PINNED if args.device == "cpu" else {},
        "no_ynn_env": NO_YNN,
        "models": [
            measure_model(m, args.size, args.device, args.budgets)
            for m in args.models or SIZES[args.size]["models"]
        ],
    }
    return measure.write_json(args.out, NAME, results)


# The report -----------------------------------------------------------------


def _per_s(entry: dict[str, Any] | None, batch: int | None) -> float | None:
    if not entry or "median_s" not in entry or not batch:
        return None
    return batch / entry["median_s"]


def markdown(results: dict, out: str) -> str:
    """Per model and budget: batches, throughput, equal-batch times, faults."""
    from benchmarks import measure

    del out
    tiny = results["size"] == "tiny"
    lines = [
        "## At a fixed memory budget",
        "",
        f"Device: {results['device']}. The budget counts "
        f"{results['budget_counts']}. Timings: medians of interleaved rounds in "
        f"one fresh process per comparison, environment "
        f"`{results['timing_env'] or 'default'}`.",
    ]
    if tiny:
        lines += ["", "Tiny run: single timings of toy steps are left out."]
    for res in results["models"]:
        base = baseline(res["model"])
        lines += [
            "",
            f"### {res['model']}, depth {res['depth']}",
            "",
            f"Sizes: `{json.dumps(res['sizes'])}`.",
        ]
        for b in res["budgets"]:
            rows = []
            for m, fit in b["fits"].items():
                own = b["timed"].get(m, {})
                eq, eq_base = b["equal"].get(m, {}), b["equal"].get(base, {})
                ratio = (
                    eq["median_s"] / eq_base["median_s"]
                    if "median_s" in eq and "median_s" in eq_base
                    else None
                )
                timings = [_per_s(own, fit["batch"]), eq.get("median_s"), ratio]
                rows.append([m, fit["batch"], *([None] * 3 if tiny else timings)])
            lines += [
                "",
                f"Budget {b['budget_mib']} MiB; equal batch "
                f"{b['equal_batch']} (what {base} fits):",
                "",
                measure.table(
                    [
                        "method",
                        "largest batch",
                        "examples/s",
                        "step s at equal batch",
                        f"÷ {base}",
                    ],
                    rows,
                ),
            ]
            for setting, per in b["faults"].items():
                frows = []
                for m, f in per.items():
                    if "fault_bytes_per_step" not in f:
                        frows.append([m, None, None, f.get("error"), None])
                        continue
                    plan = f["temp_bytes"] + f.get("output_bytes", 0)
                    frows.append(
                        [
                            m,
                            f["fault_bytes_per_step"] / MIB,
                            plan / MIB,
                            f["fault_bytes_per_step"] / max(plan, 1),
                            f.get("step_rss_increase_mib"),
                        ]
                    )
                lines += [
                    "",
                    f"Page faults per step at each method's largest "
                    f"batch, default allocator, XLA `{setting}`; the last "
                    "column is the peak resident size during the timed steps "
                    "over the resident size before them:",
                    "",
                    measure.table(
                        [
                            "method",
                            "faulted MiB",
                            "temp + out MiB",
                            "ratio",
                            "peak RSS rise MiB",
                        ],
                        frows,
                    ),
                ]
        drows = [[m, d["depth"]] for m, d in res["depths"].items()]
        lines += [
            "",
            f"Largest depth at batch {res['depth_batch']} within "
            f"{min(b['budget_mib'] for b in res['budgets'])} MiB:",
            "",
            measure.table(["method", "depth"], drows),
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].startswith("{"):
        start = time.perf_counter()
        got = worker(json.loads(sys.argv[1]))
        print(json.dumps({**got, "worker_s": time.perf_counter() - start}))
    else:
        main()
