"""Peers' time-steppers: revnet beside each peer's own way to differentiate them.

Three workloads, the examples' own (``examples/md_nve.py``,
``examples/neural_ode_heun.py``, ``examples/fdtd_design.py``), each at
several step counts:

* **jax-md**: 16 soft spheres, jax-md's ``simulate.nve`` step unchanged;
  revnet inverting it (``mode="invert"``, ``decisions="recompute"``) against
  ``jax.checkpoint`` over ``lax.scan`` (a jax-md user's usual way) and plain
  ``lax.scan``.
* **diffrax**: a neural ODE, diffrax's ``ReversibleHeun().step`` unchanged;
  revnet inverting it against diffrax's own ``diffeqsolve`` with
  ``RecursiveCheckpointAdjoint`` and plain ``lax.scan``.
* **fdtdx**: a 16 x 16 FDTD plane with periodic boundaries, fdtdx's update
  unchanged; revnet inverting it against ``jax.checkpoint`` over ``lax.scan``
  (fdtdx's ``checkpointed_fdtd``'s program).

For each method and step count: the compiled temp memory and FLOPs of
``jit(grad(loss))`` (compiled, not run; a scan body's FLOPs are counted once),
and, up to 10,000 steps, the median time of a gradient and its largest error
relative to the reference (``jax.checkpoint``/diffrax's own solve), as
measured here. Needs the simulation extra (``pip install -e '.[simulation]'``);
without it the report says so.

    python -m benchmarks.simulation [--quick | --tiny] [--out results]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks import measure

NAME = "simulation"
STEPS = {
    "tiny": [100, 1_000],
    "quick": [1_000, 10_000],
    "full": [1_000, 10_000, 100_000],
}
RUN_UP_TO = 10_000  # longer runs are compiled only
METHODS = {
    "jax-md": ("revnet", "checkpoint", "lax.scan"),
    "diffrax": ("revnet", "diffrax", "lax.scan"),
    "fdtdx": ("revnet", "checkpoint"),
}
REFERENCE = {"jax-md": "checkpoint", "diffrax": "diffrax", "fdtdx": "checkpoint"}


def _workload(name: str) -> tuple[Any, Any, Any]:
    """``(loss(steps, method), argument, example module)`` of a workload."""
    import jax
    import jax.numpy as jnp

    if name == "jax-md":
        md = measure.load_example_module("md_nve")
        r0, p0 = md.initial_state()
        target = md.final_positions(jnp.log(1.2), r0, p0, 100, "lax")
        return (lambda n, m: md.loss_fn(n, m, r0, p0, target)), jnp.float32(0.0), md
    if name == "fdtdx":
        fdtd = measure.load_example_module("fdtd_design")
        design = 0.3 * jax.random.normal(jax.random.PRNGKey(1), (4, 4, 1))
        return (lambda n, m: fdtd.loss_fn(n, False, m)), design, fdtd
    ode = measure.load_example_module("neural_ode_heun")
    ky, kw = jax.random.split(jax.random.PRNGKey(0))
    y0 = jax.random.normal(ky, (ode.BATCH, ode.DIM))
    target = ode.targets(y0)
    return (lambda n, m: ode.loss_fn(n, m, y0, target)), ode.init_params(kw), ode


def _method_name(workload: str, method: str) -> str:
    """The examples' names for the methods (``lax`` for plain ``lax.scan``)."""
    if workload == "jax-md" and method == "lax.scan":
        return "lax"
    if workload == "fdtdx":
        return {"revnet": "invert", "checkpoint": "reference"}[method]
    return method


def measure_workload(name: str, steps: Sequence[int], repeats: int) -> list[dict]:
    """Memory, FLOPs, time and gradient error of every method at every count."""
    import jax

    loss, arg, _ = _workload(name)
    rows = []
    for n in steps:
        grads, fns = {}, {}
        for method in METHODS[name]:
            fn = jax.grad(loss(n, _method_name(name, method)))
            compiled, stats = measure.compile_stats(fn, arg)
            row = {"workload": name, "method": method, "steps": n, **stats}
            if n <= RUN_UP_TO:
                grads[method] = compiled(arg)
                fns[method] = lambda c=compiled: c(arg)
            rows.append(row)
        if fns:
            times = measure.median_times(fns, repeats, warmup=1)
            want = jax.tree.leaves(grads[REFERENCE[name]])
            for row in rows[-len(METHODS[name]) :]:
                got = jax.tree.leaves(grads[row["method"]])
                row["median_s"] = times[row["method"]]["median_s"]
                row["grad_rel_error"] = max(
                    float(abs(a - b).max() / abs(b).max()) for a, b in zip(got, want)
                )
    return rows


def main(argv: Sequence[str] | None = None) -> dict:
    """Runs both workloads; writes ``<out>/simulation.json``."""
    args = measure.parse(__doc__, argv)
    results: dict = {"size": args.size, "steps": STEPS[args.size], "rows": []}
    repeats = 3 if args.size != "full" else 5
    for name in METHODS:
        try:
            rows = measure_workload(name, STEPS[args.size], repeats)
        except ImportError as err:  # the simulation extra is not installed
            results.setdefault("missing", []).append(f"{name}: {err}")
            continue
        results["rows"] += rows
    return measure.write_json(args.out, NAME, results)


def markdown(results: dict, out: str) -> str:
    """One table per workload: memory at each count, then time and error."""
    del out
    parts = ["## Peers' time-steppers\n"]
    for line in results.get("missing", []):
        parts.append(f"Not measured (the simulation extra is missing): {line}\n")
    steps = results["steps"]
    for name, methods in METHODS.items():
        by = {
            (r["method"], r["steps"]): r
            for r in results["rows"]
            if r["workload"] == name
        }
        if not by:
            continue
        ran = [n for n in steps if n <= RUN_UP_TO]
        header = ["method"] + [f"temp KiB, {n:,}" for n in steps]
        header += [f"ms / grad, {n:,}" for n in ran] + [f"grad error, {ran[-1]:,}"]
        rows = []
        for m in methods:
            row = [m] + [by[m, n]["temp_bytes"] / 1024 for n in steps]
            row += [by[m, n]["median_s"] * 1e3 for n in ran]
            row += [by[m, ran[-1]]["grad_rel_error"]]
            rows.append(row)
        parts.append(f"**{name}** (error against {REFERENCE[name]}):\n")
        parts.append(measure.table(header, rows) + "\n")
    return "\n".join(parts)


if __name__ == "__main__":
    main()
