"""A reversible leapfrog integrator trained end to end with ``revnet.while_loop``.

A particle moves in a learned 2-D potential ``V(q) = |q|^2/2 + MLP(q)``. The
model integrates Hamilton's equations with leapfrog (kick-drift-kick), which is
invertible step by step, so ``revnet.while_loop`` differentiates through it by
running the steps backwards instead of storing the trajectory. Each trajectory
of a batch runs to its own end time (a data-dependent stopping condition: under
``vmap`` every element has its own trip count), and the MLP is fitted with optax
to final states of the Henon-Heiles system. Last, for a few step counts, the
compiled temp memory of ``jit(grad(loss))`` is printed for ``revnet.while_loop``,
``lax.scan`` and ``lax.scan`` over a ``jax.checkpoint``-ed step.

    python examples/while_loop.py                  # 200 training steps
    python examples/while_loop.py --smoke          # a few tiny steps, seconds
    python examples/while_loop.py --out runs/wl    # writes runs/wl/while_loop.json
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # _flags, _state, revnet from a checkout

import _flags  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; a bad one ends the program with one line (exit status 2)."""
    parser = _flags.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--smoke", action="store_true", help="a few tiny steps")
    add("--steps", type=_flags.positive_int, default=None, help="training steps")
    add("--out", type=_flags.writable_dir, help="writes DIR/while_loop.json")
    add("--seed", type=_flags.non_negative_int, default=0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # bad flags end here, before the slow imports below

import _state  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402

import revnet  # noqa: E402

DT = 0.05
METHODS = ("revnet.while_loop", "lax.scan", "checkpointed lax.scan")


def init_mlp(key: jax.Array, width: int) -> dict:
    """Parameters of the learned part of the potential, a 2-layer tanh MLP."""
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "w1": jax.random.normal(k1, (2, width)) / np.sqrt(2.0),
        "b1": jnp.zeros(width),
        "w2": jax.random.normal(k2, (width, width)) / np.sqrt(width),
        "b2": jnp.zeros(width),
        "w3": 0.1 * jax.random.normal(k3, (width,)) / np.sqrt(width),
    }


def potential(params: dict, q: jax.Array) -> jax.Array:
    """The model's potential at one position ``q`` (shape ``(2,)``)."""
    h = jnp.tanh(q @ params["w1"] + params["b1"])
    h = jnp.tanh(h @ params["w2"] + params["b2"])
    return 0.5 * jnp.sum(q**2) + h @ params["w3"]


def henon_heiles(q: jax.Array) -> jax.Array:
    """The true potential the data comes from."""
    return 0.5 * jnp.sum(q**2) + q[0] ** 2 * q[1] - q[1] ** 3 / 3.0


def leapfrog(potential_fn, dt: float):
    """One kick-drift-kick step of ``(q, p)``; each part is an additive coupling."""
    force = jax.grad(potential_fn)  # minus the force

    def step(q, p):
        p = p - 0.5 * dt * force(q)
        q = q + dt * p
        return q, p - 0.5 * dt * force(q)

    return step


def integrate_until(params, q0, p0, t_end, max_steps: int):
    """One trajectory until ``t >= t_end`` with ``revnet.while_loop``.

    The carry holds an integer step counter (updated invertibly, ``i + 1``) that
    the stopping condition reads. Returns ``(q, p, steps)``.
    """
    step = leapfrog(lambda q: potential(params, q), DT)

    def body(carry):
        q, p, i = carry
        return (*step(q, p), i + 1)

    cond = lambda carry: carry[2] * DT < t_end  # noqa: E731
    return revnet.while_loop(cond, body, (q0, p0, 0), max_steps=max_steps)


def make_data(key: jax.Array, batch: int, t_max: float) -> dict:
    """Initial states, end times, and final states of the true system."""
    kq, kp, kt = jax.random.split(key, 3)
    q0 = 0.3 * jax.random.normal(kq, (batch, 2))
    p0 = 0.3 * jax.random.normal(kp, (batch, 2))
    t_end = jax.random.uniform(kt, (batch,), minval=t_max / 4, maxval=t_max)
    n = jnp.ceil(t_end / DT).astype(jnp.int32)
    fine = leapfrog(henon_heiles, DT / 8)  # 8 substeps per model step

    def truth(q, p, n):
        return lax.fori_loop(0, 8 * n, lambda _, c: fine(*c), (q, p))

    q, p = jax.jit(jax.vmap(truth))(q0, p0, n)
    return {"q0": q0, "p0": p0, "t_end": t_end, "q": q, "p": p}


def loss(params: dict, data: dict, max_steps: int) -> jax.Array:
    """Mean squared error of the final ``(q, p)``; each element its own steps."""
    q, p, _ = jax.vmap(integrate_until, (None, 0, 0, 0, None))(
        params, data["q0"], data["p0"], data["t_end"], max_steps
    )
    return jnp.mean(jnp.sum((q - data["q"]) ** 2 + (p - data["p"]) ** 2, -1))


def fixed_steps_loss(method: str, params: dict, q0, p0, n: int) -> jax.Array:
    """A batch integrated for exactly ``n`` steps with ``method``."""
    step = leapfrog(lambda q: jnp.sum(jax.vmap(potential, (None, 0))(params, q)), DT)
    if method == "revnet.while_loop":
        body = lambda c: (*step(c[0], c[1]), c[2] + 1)  # noqa: E731
        q, p, _ = revnet.while_loop(lambda c: c[2] < n, body, (q0, p0, 0), max_steps=n)
    else:
        f = lambda c, _: (step(*c), None)  # noqa: E731
        f = jax.checkpoint(f) if method == "checkpointed lax.scan" else f
        (q, p), _ = lax.scan(f, (q0, p0), None, length=n)
    return jnp.mean(q**2) + jnp.mean(p**2)


def temp_bytes(method: str, params: dict, q0, p0, n: int) -> int:
    """Compiled temp memory of ``jit(grad(loss))`` for ``n`` steps."""
    grad = jax.grad(lambda w: fixed_steps_loss(method, w, q0, p0, n))
    compiled = jax.jit(grad).lower(params).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    batch, width, t_max = (4, 8, 1.0) if args.smoke else (32, 32, 4.0)
    train_steps = args.steps or (3 if args.smoke else 200)
    counts = [8, 32] if args.smoke else [16, 128, 1024]
    max_steps = int(np.ceil(t_max / DT)) + 1

    key_data, key_init = jax.random.split(jax.random.PRNGKey(args.seed))
    data = make_data(key_data, batch, t_max)
    params = init_mlp(key_init, width)
    optimiser = optax.adam(1e-2)

    @jax.jit
    def update(params, opt_state):
        value, grads = jax.value_and_grad(loss)(params, data, max_steps)
        updates, opt_state = optimiser.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    opt_state, losses = optimiser.init(params), []
    for i in range(train_steps):
        params, opt_state, value = update(params, opt_state)
        losses.append(float(value))
        if i % max(1, train_steps // 10) == 0 or i == train_steps - 1:
            print(f"step {i}: loss {value:.3e}", flush=True)
    memory = []
    for n in counts:
        for method in METHODS:
            row = {"method": method, "steps": n}
            row["temp_bytes"] = temp_bytes(method, params, data["q0"], data["p0"], n)
            memory.append(row)
            print(f"{method:>22}, {n:5d} steps: {row['temp_bytes'] / 2**20:.3f} MiB")
    results = {"config": {"smoke": args.smoke, "batch": batch, "width": width}}
    results.update({"losses": losses, "memory": memory})
    if args.out:
        _state.write_json(os.path.join(args.out, "while_loop.json"), results)
    return results


if __name__ == "__main__":
    try:
        main()
    except OSError as err:  # writing the results failed: one line, exit 1
        _flags.fail(err)
