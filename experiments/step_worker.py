"""Runs real training steps of one configuration and reports its peak RSS.

Run as ``python -m experiments.step_worker '<spec as JSON>'`` by
:func:`experiments.common.peak_rss_subprocess`, one process per configuration,
so that one configuration's allocations cannot inflate another's high-water
mark. Prints one JSON line: ``peak_rss_mib`` (the whole process's peak,
dominated by imports and XLA compilation, NOT by the step; ``setup_peak_rss_mib``
is ``ru_maxrss`` before the steps),
``rss_before_step_mib`` (resident memory after compiling and allocating
parameters and data) and ``step_peak_rss_mib``/``step_rss_increase_mib``:
the high-water mark during the training steps alone and its increase over
``rss_before_step_mib``. On Linux the high-water mark is reset just before the
steps (``echo 5 > /proc/self/clear_refs``), so compilation's peak does not
mask the step's; ``step_hwm_reset`` says whether that worked (if not, the
step figures are upper bounds set by compilation).

With ``"time_steps": n`` in the spec it instead times ``n`` gradient steps
(``jit(grad)``, parameters unchanged, after two warm-up steps, with
:func:`experiments.common.median_times`) and prints ``median_s``, ``min_s``,
``max_s`` and the compiled step's ``temp_bytes`` and ``flops``:
:mod:`experiments.speed` runs one such process per measurement.
"""

from __future__ import annotations

import json
import resource
import sys


def _maxrss_mib() -> float:
    # Linux reports ru_maxrss in KiB (macOS in bytes).
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20


def _status_mib(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return None


def _reset_hwm() -> bool:
    """Resets the peak RSS to the current RSS (Linux >= 4.0); True on success."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def main(argv: list[str]) -> int:
    """Builds the spec in ``argv[0]``, runs SGD steps and prints the RSS."""
    if len(argv) != 1:
        print("usage: python -m experiments.step_worker '<spec json>'", file=sys.stderr)
        return 2
    import jax

    from experiments import models

    spec = json.loads(argv[0])
    built = models.build(spec)
    if "time_steps" in spec:
        print(json.dumps(_time_steps(built, int(spec["time_steps"]))))
        return 0
    steps = int(spec.get("steps", 3))

    def train_step(params, state, x, y):
        loss, grads, state = built.grad_step(params, state, x, y)
        params = jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)
        return params, state, loss

    step = jax.jit(train_step, donate_argnums=(0, 1))
    params, state, x, y = built.args
    compiled = step.lower(params, state, x, y).compile()
    jax.block_until_ready((params, state, x, y))
    setup_peak = _maxrss_mib()  # imports + compilation + allocation
    reset = _reset_hwm()
    before = _status_mib("VmRSS")
    for _ in range(steps):
        params, state, loss = compiled(params, state, x, y)
    jax.block_until_ready(loss)
    step_peak = _status_mib("VmHWM") if reset else None
    if before is None or step_peak is None:  # not Linux: compile-dominated
        before, step_peak, reset = before or _maxrss_mib(), _maxrss_mib(), False
    print(
        json.dumps(
            {
                "peak_rss_mib": max(setup_peak, _maxrss_mib()),
                "setup_peak_rss_mib": setup_peak,
                "rss_before_step_mib": before,
                "step_peak_rss_mib": step_peak,
                "step_rss_increase_mib": step_peak - before,
                "step_hwm_reset": reset,
                "steps": steps,
                "loss": float(loss),
            }
        )
    )
    return 0


def _time_steps(built, n: int) -> dict:
    from experiments import common

    compiled, stats = common.compile_stats(built.grad_step, *built.args)
    times = common.median_times({"step": lambda: compiled(*built.args)}, n)["step"]
    keep = ("temp_bytes", "flops", "compile_s")
    return {**times, **{k: stats[k] for k in keep}}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
