"""Runs real training steps of one configuration and reports its peak RSS.

Run as ``python -m experiments.step_worker '<spec as JSON>'`` by
:func:`experiments.common.peak_rss_subprocess`, one process per configuration,
so that one configuration's allocations cannot inflate another's high-water
mark. Prints one JSON line: ``peak_rss_mib`` (``ru_maxrss`` at exit),
``rss_before_step_mib`` (after compiling and allocating parameters and data)
and ``step_rss_increase_mib`` (what running the steps added to the peak).
"""

from __future__ import annotations

import json
import resource
import sys


def _maxrss_mib() -> float:
    # Linux reports ru_maxrss in KiB (macOS in bytes).
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20


def main(argv: list[str]) -> int:
    """Builds the spec in ``argv[0]``, runs SGD steps and prints the RSS."""
    if len(argv) != 1:
        print("usage: python -m experiments.step_worker '<spec json>'", file=sys.stderr)
        return 2
    import jax

    from experiments import models

    spec = json.loads(argv[0])
    built = models.build(spec)
    steps = int(spec.get("steps", 3))

    def train_step(params, state, x, y):
        loss, grads, state = built.grad_step(params, state, x, y)
        params = jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)
        return params, state, loss

    step = jax.jit(train_step, donate_argnums=(0, 1))
    params, state, x, y = built.args
    compiled = step.lower(params, state, x, y).compile()
    jax.block_until_ready((params, state, x, y))
    before = _maxrss_mib()
    for _ in range(steps):
        params, state, loss = compiled(params, state, x, y)
    jax.block_until_ready(loss)
    peak = _maxrss_mib()
    print(
        json.dumps(
            {
                "peak_rss_mib": peak,
                "rss_before_step_mib": before,
                "step_rss_increase_mib": peak - before,
                "steps": steps,
                "loss": float(loss),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
