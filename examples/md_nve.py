"""jax-md's own NVE step, differentiated backwards in flat memory.

Sixteen soft spheres in a harmonic trap are integrated by jax-md's
``simulate.nve`` (velocity Verlet; its state carries the force at the current
positions), unchanged, inside ``revnet.scan(..., mode="invert")``. The carried
force is a *derived* leaf: the step overwrites it with the force at the new
positions, so revnet rebuilds it, running backwards, from the positions the
step before left. The soft sphere's cutoff and jax-md's safe mask are selects
whose branches meet continuously, so their predicates are recomputed from the
rebuilt positions (``decisions="recompute"``) rather than stored per step. The
backward pass holds one state (and, the system being chaotic, the state every
1,000 steps: an anchor, from which rebuilding restarts). The loss is the
distance of the final positions to those of a reference run with another
sphere size; gradient steps fit the size. (Much longer runs are chaotic: at
4,000 steps a one-ulp change of the initial positions moves the gradient by
2%, at 10,000 steps by a factor of hundreds, whatever the method.)

The example

1. compares the gradient with ``jax.checkpoint`` over ``lax.scan`` of the same
   step (what a jax-md user writes today): the largest difference relative to
   the gradient;
2. prints the compiled temp memory of ``jit(grad(loss))`` for both at two
   step counts (compiled, not run);
3. takes a few gradient steps on ``log(sigma)``.

    python examples/md_nve.py                  # 2,000 steps
    python examples/md_nve.py --smoke          # 1,000 steps, seconds
    python examples/md_nve.py --out runs/md    # writes md_nve.json

It needs jax-md: ``pip install -e '.[simulation]'``.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # _flags, _durable, revnet from a checkout

import _flags  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; a bad one ends the program with one line (exit status 2)."""
    parser = _flags.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--smoke", action="store_true", help="1,000 steps, two updates")
    add("--steps", type=_flags.positive_int, default=None, help="default 2,000")
    add("--updates", type=_flags.positive_int, default=None, help="default 5")
    add("--out", type=_flags.writable_dir, help="writes DIR/md_nve.json")
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # bad flags end here, before the slow imports below
    try:
        import jax_md  # noqa: F401
    except ImportError:
        _flags.fail("jax-md is not installed: pip install -e '.[simulation]'")

import _durable  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax_md import energy, simulate, space  # noqa: E402

import revnet  # noqa: E402

PARTICLES, DT, TRAP, KT, LR, ANCHOR = 16, 5e-3, 0.2, 0.5, 0.1, 1_000


def initial_state():
    """Positions on a jittered grid and momenta of zero mean."""
    g = (np.arange(4) + 0.5) * 1.1
    r = np.stack(np.meshgrid(g, g), -1).reshape(-1, 2)
    r = r + 0.05 * np.random.RandomState(0).randn(PARTICLES, 2)
    p = np.random.RandomState(1).randn(PARTICLES, 2) * np.sqrt(KT)
    return jnp.asarray(r, jnp.float32), jnp.asarray(p - p.mean(0), jnp.float32)


def final_positions(log_sigma, r0, p0, steps: int, loop: str):
    """The positions after ``steps`` of jax-md's NVE step."""
    displacement, shift = space.free()
    soft = energy.soft_sphere_pair(displacement, sigma=jnp.exp(log_sigma))

    def energy_fn(r, **kw):
        return soft(r, **kw) + 0.5 * TRAP * jnp.sum((r - 2.2) ** 2)

    init_fn, step_fn = simulate.nve(energy_fn, shift, dt=DT)
    state = init_fn(jax.random.PRNGKey(0), r0, KT, momenta=p0)

    def body(s, _):
        return step_fn(s), None

    if loop == "revnet":
        # The soft sphere's cutoff (``dr < sigma``) and jax-md's safe mask
        # (``dr > 0``) are selects whose branches meet continuously: their
        # predicates are recomputed from the rebuilt positions, not stored.
        # The system is chaotic: an anchor every 1,000 steps keeps rounding
        # error from growing past the boundary check's tolerance.
        final, _ = revnet.scan(
            body, state, None, length=steps, mode="invert", decisions="recompute",
            anchor_every=ANCHOR,
        )  # fmt: skip
    else:  # jax.checkpoint over lax.scan, jax-md's usual way
        final, _ = jax.lax.scan(jax.checkpoint(body), state, None, length=steps)
    return final.position


def loss_fn(steps: int, loop: str, r0, p0, target):
    def loss(log_sigma):
        r = final_positions(log_sigma, r0, p0, steps, loop)
        return jnp.mean((r - target) ** 2)

    return loss


def temp_bytes(fn, *args) -> int:
    """Compiled temp memory of ``jit(fn)`` (not run)."""
    compiled = jax.jit(fn).lower(*args).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    steps = args.steps or (1_000 if args.smoke else 2_000)
    updates = args.updates or (2 if args.smoke else 5)
    r0, p0 = initial_state()
    target = final_positions(jnp.log(1.2), r0, p0, steps, "lax")
    log_sigma = jnp.asarray(0.0, jnp.float32)  # start at sigma = 1
    print(f"{steps:,} NVE steps of {PARTICLES} soft spheres (jax-md's step)")

    grads = {
        loop: jax.jit(jax.grad(loss_fn(steps, loop, r0, p0, target)))(log_sigma)
        for loop in ("revnet", "checkpoint")
    }
    rel = float(abs(grads["revnet"] - grads["checkpoint"]) / abs(grads["checkpoint"]))
    print(
        f"d loss / d log(sigma): revnet {float(grads['revnet']):.6g}, "
        f"jax.checkpoint {float(grads['checkpoint']):.6g} (relative {rel:.1e})"
    )
    results = {"config": {"steps": steps, "smoke": args.smoke}, "grad_rel_diff": rel}

    memory: dict = {}
    for n in (steps // 10, steps):
        for loop in ("revnet", "checkpoint"):
            fn = jax.grad(loss_fn(n, loop, r0, p0, target))
            memory.setdefault(loop, {})[str(n)] = temp_bytes(fn, log_sigma)
        print(
            f"temp memory of jit(grad(loss)), {n:>6,} steps: revnet "
            f"{memory['revnet'][str(n)]:,} B, jax.checkpoint "
            f"{memory['checkpoint'][str(n)]:,} B"
        )
    results["memory"] = memory

    step = jax.jit(jax.value_and_grad(loss_fn(steps, "revnet", r0, p0, target)))
    losses = []
    for i in range(updates):
        value, g = step(log_sigma)
        log_sigma = log_sigma - LR * jnp.sign(g) * jnp.minimum(1.0, jnp.abs(g))
        losses.append(float(value))
        print(f"update {i}: loss {value:.5f}, sigma {float(jnp.exp(log_sigma)):.4f}")
    results["losses"] = losses
    if args.out:
        _durable.write_json(os.path.join(args.out, "md_nve.json"), results)
    return results


if __name__ == "__main__":
    try:
        main()
    except OSError as err:  # writing the results failed: one line, exit 1
        _flags.fail(err)
