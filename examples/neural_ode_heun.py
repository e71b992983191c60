"""A neural ODE stepped by diffrax's reversible Heun solver, inverted by revnet.

The vector field is a small tanh MLP; the solution is stepped by diffrax's own
``ReversibleHeun().step``, unchanged, inside ``revnet.scan(...,
mode="invert")``. The solver carries ``(y, yhat, vf)``, ``vf`` being its last
vector-field evaluation, so that each step makes one evaluation. Running
backwards, revnet rebuilds ``vf`` from ``yhat`` by the step before (a derived
leaf) and solves ``yhat0`` from the step's two equations together
(``yhat1 - 2 y1 = -yhat0 - h vf1``): one evaluation a step forward, one state
held backward. The loss is the distance of the final states of a batch of
initial conditions to those of a damped rotation; gradient steps fit the MLP.

The example

1. compares the gradient with diffrax's own ``diffeqsolve`` with
   ``RecursiveCheckpointAdjoint`` (the same solver and float program);
2. prints the compiled temp memory of ``jit(grad(loss))`` for revnet,
   diffrax's recursive checkpointing, and plain ``lax.scan`` of the step;
3. takes a few normalised gradient steps.

    python examples/neural_ode_heun.py                # 10,000 steps
    python examples/neural_ode_heun.py --smoke        # 1,000 steps, seconds
    python examples/neural_ode_heun.py --out runs/ode # writes neural_ode_heun.json

It needs diffrax: ``pip install -e '.[simulation]'``.
"""

from __future__ import annotations

import argparse
import functools
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
    add("--steps", type=_flags.positive_int, default=None, help="default 10,000")
    add("--updates", type=_flags.positive_int, default=None, help="default 5")
    add("--out", type=_flags.writable_dir, help="writes DIR/neural_ode_heun.json")
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # bad flags end here, before the slow imports below
    try:
        import diffrax  # noqa: F401
    except ImportError:
        _flags.fail("diffrax is not installed: pip install -e '.[simulation]'")

import _durable  # noqa: E402
import diffrax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import revnet  # noqa: E402

DIM, WIDTH, BATCH, T1, LR = 2, 32, 16, 5.0, 0.05
SOLVER = diffrax.ReversibleHeun()


def vector_field(t, y, params):
    """The MLP ``y -> W2 tanh(W1 y + b1)``, batched over the rows of ``y``."""
    return jnp.tanh(y @ params["w1"] + params["b1"]) @ params["w2"]


def init_params(key: jax.Array) -> dict:
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (DIM, WIDTH)) / DIM**0.5,
        "b1": jnp.zeros(WIDTH),
        "w2": 0.1 * jax.random.normal(k2, (WIDTH, DIM)) / WIDTH**0.5,
    }


def solve(params, y0, steps: int, loop: str):
    """The state at ``T1`` from ``y0`` after ``steps`` reversible Heun steps."""
    term, dt = diffrax.ODETerm(vector_field), T1 / steps
    if loop == "diffrax":
        return diffrax.diffeqsolve(
            term, SOLVER, 0.0, T1, dt, y0, args=params, max_steps=steps,
            saveat=diffrax.SaveAt(t1=True),
            adjoint=diffrax.RecursiveCheckpointAdjoint(),
        ).ys[-1]  # fmt: skip

    def step(carry, _):  # the clock t is carried: nothing is stored per step
        y, state, t0 = carry
        t1 = t0 + dt
        y, _, _, state, _ = SOLVER.step(term, t0, t1, y, params, state, False)
        return (y, state, t1), None

    init = (y0, SOLVER.init(term, 0.0, dt, y0, params), jnp.zeros((), y0.dtype))
    scan = functools.partial(revnet.scan, mode="invert")
    if loop == "lax.scan":
        scan = jax.lax.scan
    (y, _, _), _ = scan(step, init, None, length=steps)
    return y


def targets(y0):
    """A damped rotation's state at ``T1``: the dynamics the MLP is fitted to."""
    angle, decay = 0.8 * T1, jnp.exp(-0.1 * T1)
    c, s = jnp.cos(angle), jnp.sin(angle)
    return decay * y0 @ jnp.array([[c, s], [-s, c]])


def loss_fn(steps: int, loop: str, y0, target):
    return lambda params: jnp.mean((solve(params, y0, steps, loop) - target) ** 2)


def temp_bytes(fn, *args) -> int:
    """Compiled temp memory of ``jit(fn)`` (not run)."""
    compiled = jax.jit(fn).lower(*args).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    steps = args.steps or (1_000 if args.smoke else 10_000)
    updates = args.updates or (2 if args.smoke else 5)
    ky, kw = jax.random.split(jax.random.PRNGKey(0))
    y0 = jax.random.normal(ky, (BATCH, DIM))
    target, params = targets(y0), init_params(kw)
    print(f"{steps:,} reversible Heun steps of a neural ODE (diffrax's step)")

    grads = {
        loop: jax.jit(jax.grad(loss_fn(steps, loop, y0, target)))(params)
        for loop in ("revnet", "diffrax")
    }
    pairs = list(zip(*map(jax.tree.leaves, grads.values())))
    rel = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in pairs)
    print(f"gradient, revnet vs diffrax's own solve: max relative difference {rel:.1e}")
    results = {"config": {"steps": steps, "smoke": args.smoke}, "grad_rel_diff": rel}

    memory: dict = {}
    for n in (steps // 10, steps):
        for loop in ("revnet", "diffrax", "lax.scan"):
            fn = jax.grad(loss_fn(n, loop, y0, target))
            memory.setdefault(loop, {})[str(n)] = temp_bytes(fn, params)
        print(
            f"temp memory of jit(grad(loss)), {n:>6,} steps: "
            + ", ".join(f"{k} {v[str(n)]:,} B" for k, v in memory.items())
        )
    results["memory"] = memory

    step = jax.jit(jax.value_and_grad(loss_fn(steps, "revnet", y0, target)))
    losses = []
    for i in range(updates):
        value, g = step(params)
        norm = jnp.sqrt(sum(jnp.sum(d**2) for d in jax.tree.leaves(g)))
        params = jax.tree.map(lambda w, d: w - LR * d / norm, params, g)
        losses.append(float(value))
        print(f"update {i}: loss {value:.5f}, |grad| {norm:.3g}")
    results["losses"] = losses
    if args.out:
        _durable.write_json(os.path.join(args.out, "neural_ode_heun.json"), results)
    return results


if __name__ == "__main__":
    try:
        main()
    except OSError as err:  # writing the results failed: one line, exit 1
        _flags.fail(err)
