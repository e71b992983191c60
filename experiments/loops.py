"""A reversible leapfrog integrator trained end to end, and its memory vs steps.

A particle moves in a learned 2-D potential ``V(q) = |q|^2/2 + MLP(q)``; the
model integrates Hamilton's equations with leapfrog (kick-drift-kick), which is
invertible step by step, so ``revnet.while_loop`` can differentiate through it
without storing the trajectory. Each trajectory in a batch runs to its own end
time (a data-dependent stopping condition, so under ``vmap`` every element has
its own trip count), and the MLP is fitted with optax to final states of the
Henon-Heiles system. Then, for a growing number of steps, the compiled memory
(``memory_analysis().temp_size_in_bytes``) and FLOPs (``cost_analysis``) of
``jit(grad(loss))`` are measured for ``revnet.while_loop``, ``revnet.scan``,
plain ``lax.scan`` and ``lax.scan`` over a ``jax.checkpoint``-ed step. Last,
:mod:`experiments.loop_compare` compares loops over an invertible, a partly
invertible and a non-invertible body, four ways each, in memory, body
evaluations and step time, against steps taken and against ``max_steps``.

Run ``python -m experiments.loops --help`` for the flags.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from experiments import common, loop_compare
from revnet.loops import scan, while_loop

DESCRIPTION = __doc__.split("\n\n")[0]
STEPS_QUICK = [16, 128, 1024]
STEPS_FULL = [8, 32, 128, 512, 2048, 8192]
STEPS_TINY = [8, 64]
COMPARE_STEPS = [16, 64, 256, 1024, 4096]
COMPARE_STEPS_TINY = [16, 64]
COMPARE_MAX_STEPS = [256, 1024, 4096, 16384]
COMPARE_MAX_STEPS_TINY = [64, 256]
METHODS = ("revnet.while_loop", "revnet.scan", "lax.scan", "checkpointed lax.scan")

Params = Any


# --------------------------------------------------------------------------- model


def init_mlp(key: jax.Array, width: int) -> Params:
    """Parameters of the learned part of the potential, a 2-layer tanh MLP."""
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "w1": jax.random.normal(k1, (2, width)) / np.sqrt(2.0),
        "b1": jnp.zeros(width),
        "w2": jax.random.normal(k2, (width, width)) / np.sqrt(width),
        "b2": jnp.zeros(width),
        "w3": 0.1 * jax.random.normal(k3, (width,)) / np.sqrt(width),
    }


def potential(params: Params, q: jax.Array) -> jax.Array:
    """The model's potential at one position ``q`` (shape ``(2,)``)."""
    h = jnp.tanh(q @ params["w1"] + params["b1"])
    h = jnp.tanh(h @ params["w2"] + params["b2"])
    return 0.5 * jnp.sum(q**2) + h @ params["w3"]


def henon_heiles(q: jax.Array) -> jax.Array:
    """The true potential the data comes from."""
    x, y = q[0], q[1]
    return 0.5 * (x**2 + y**2) + x**2 * y - y**3 / 3.0


def leapfrog(force: Callable[[jax.Array], jax.Array], dt: float):
    """One kick-drift-kick step of ``(q, p)``; each half is an additive coupling."""

    def step(q, p):
        p = p + 0.5 * dt * force(q)
        q = q + dt * p
        p = p + 0.5 * dt * force(q)
        return q, p

    return step


def model_force(params: Params) -> Callable[[jax.Array], jax.Array]:
    """The force ``-dV/dq`` at one position, or at a batch of them."""

    def force(q):
        if q.ndim == 1:
            return -jax.grad(potential, argnums=1)(params, q)
        total = lambda q: jnp.sum(jax.vmap(potential, (None, 0))(params, q))  # noqa: E731
        return -jax.grad(total)(q)

    return force


def true_final_state(q0, p0, n, dt, substeps):
    """The data: Henon-Heiles integrated finely for ``n`` model steps."""
    step = leapfrog(lambda q: -jax.grad(henon_heiles)(q), dt / substeps)
    return lax.fori_loop(0, n * substeps, lambda _, c: step(*c), (q0, p0))


# ------------------------------------------------------------------ integrators


def integrate_until(params, q0, p0, t_end, dt, max_steps):
    """Integrates one trajectory until ``t >= t_end``: ``revnet.while_loop``.

    The carry holds an integer step counter (updated invertibly, ``i + 1``); the
    stopping condition reads it, so each trajectory takes its own number of
    steps. Returns ``(q, p, steps)``.
    """
    step = leapfrog(model_force(params), dt)

    def body(c):
        q, p, i = c
        return (*step(q, p), i + 1)

    return while_loop(
        lambda c: c[2] * dt < t_end, body, (q0, p0, 0), max_steps=max_steps
    )


def _scan_step(params, dt):
    step = leapfrog(model_force(params), dt)
    return lambda c, _: (step(*c), None)


def integrate_fixed(method: str, params, q0, p0, n: int, dt: float):
    """Integrates a batch of trajectories for exactly ``n`` steps with ``method``.

    The batch is part of the carry (not ``vmap``-ed), as one would write it when
    every trajectory takes the same number of steps.
    """
    if method == "revnet.while_loop":
        step = leapfrog(model_force(params), dt)

        def body(c):
            q, p, i = c
            return (*step(q, p), i + 1)

        q, p, _ = while_loop(lambda c: c[2] < n, body, (q0, p0, 0), max_steps=n)
        return q, p
    f = _scan_step(params, dt)
    if method == "revnet.scan":
        return scan(f, (q0, p0), None, length=n)[0]
    if method == "lax.scan":
        return lax.scan(f, (q0, p0), None, length=n)[0]
    if method == "checkpointed lax.scan":
        return lax.scan(jax.checkpoint(f), (q0, p0), None, length=n)[0]
    raise ValueError(f"unknown method {method!r}")


def _mse(q, p, q_t, p_t):
    return jnp.mean(jnp.sum((q - q_t) ** 2 + (p - p_t) ** 2, axis=-1))


# --------------------------------------------------------------------- training


def make_data(key, batch, dt, t_range, substeps):
    """Initial states, per-trajectory end times, step counts and targets."""
    kq, kp, kt = jax.random.split(key, 3)
    q0 = 0.3 * jax.random.normal(kq, (batch, 2))
    p0 = 0.3 * jax.random.normal(kp, (batch, 2))
    t_end = jax.random.uniform(kt, (batch,), minval=t_range[0], maxval=t_range[1])
    n = jnp.ceil(t_end / dt).astype(jnp.int32)
    final = jax.jit(
        jax.vmap(true_final_state, (0, 0, 0, None, None)), static_argnums=(3, 4)
    )
    qt, pt = final(q0, p0, n, dt, substeps)
    return {"q0": q0, "p0": p0, "t_end": t_end, "n": n, "q": qt, "p": pt}


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Fits the MLP potential with optax through the reversible while loop."""
    import optax

    key_data, key_init = jax.random.split(jax.random.PRNGKey(args.seed))
    data = make_data(key_data, args.batch, args.dt, (args.t_min, args.t_max), 8)
    params = init_mlp(key_init, args.width)
    max_steps = int(np.ceil(args.t_max / args.dt)) + 1

    def loss(params, data):
        q, p, n = jax.vmap(integrate_until, (None, 0, 0, 0, None, None))(
            params, data["q0"], data["p0"], data["t_end"], args.dt, max_steps
        )
        return _mse(q, p, data["q"], data["p"]), n

    opt = optax.adam(args.lr)

    @jax.jit
    def update(params, state, data):
        (value, n), grads = jax.value_and_grad(loss, has_aux=True)(params, data)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value, n

    # The gradient the optimiser sees equals plain autodiff through lax.scan
    # with each trajectory's own number of steps.
    check = gradient_check(loss, params, data, args.dt)
    state = opt.init(params)
    losses = []
    start = time.perf_counter()
    for _ in range(args.train_steps):
        params, state, value, n = update(params, state, data)
        losses.append(float(value))
    seconds = time.perf_counter() - start
    final = float(loss(params, data)[0])
    return {
        "losses": losses + [final],
        "initial_loss": losses[0] if losses else final,
        "final_loss": final,
        "steps_per_trajectory": np.asarray(data["n"]).tolist(),
        "trip_counts_recorded": np.asarray(n).tolist() if losses else [],
        "max_steps": max_steps,
        "train_seconds": seconds,
        "gradient_check": check,
    }


def gradient_check(loss, params, data, dt) -> dict[str, Any]:
    """Max relative error of the training gradient vs ``lax.scan`` per element.

    Checked on the shortest and the longest trajectory of the batch together,
    so the vmapped while loop has two different trip counts.
    """
    pick = jnp.array([int(jnp.argmin(data["n"])), int(jnp.argmax(data["n"]))])
    sub = jax.tree_util.tree_map(lambda a: a[pick], data)
    steps = [int(n) for n in sub["n"]]
    elements = len(steps)

    def ref(params):
        total = 0.0
        for e in range(elements):
            q, p = integrate_fixed(
                "lax.scan",
                params,
                sub["q0"][e : e + 1],
                sub["p0"][e : e + 1],
                steps[e],
                dt,
            )
            total = total + jnp.sum((q - sub["q"][e]) ** 2 + (p - sub["p"][e]) ** 2)
        return total / elements

    got = jax.jit(jax.grad(lambda p: loss(p, sub)[0]))(params)
    want = jax.jit(jax.grad(ref))(params)
    errs = [
        float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w)))
        for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want))
    ]
    return {"max_rel_error_vs_lax_scan": max(errs), "trip_counts": steps}


# ---------------------------------------------------------------------- sweeps


def measure(args: argparse.Namespace, steps: Sequence[int]) -> list[dict[str, Any]]:
    """Compiled memory and FLOPs of ``jit(grad(loss))`` per method and steps."""
    params = init_mlp(jax.random.PRNGKey(args.seed), args.width)
    key_q, key_p = jax.random.split(jax.random.PRNGKey(args.seed + 1))
    q0 = 0.3 * jax.random.normal(key_q, (args.batch, 2))
    p0 = 0.3 * jax.random.normal(key_p, (args.batch, 2))
    rows = []
    for n in steps:
        for method in METHODS:

            def loss(params, q0, p0, method=method, n=n):
                q, p = integrate_fixed(method, params, q0, p0, n, args.dt)
                return jnp.mean(q**2) + jnp.mean(p**2)

            _, stats = common.compile_stats(jax.grad(loss), params, q0, p0)
            rows.append({"method": method, "steps": n, **stats})
            print(
                f"  {method:>22} steps {n:5d}: temp "
                f"{stats['temp_bytes'] / common.MIB:9.3f} MiB, flops "
                f"{stats['flops']:.3g}",
                flush=True,
            )
    return rows


def plot(
    rows: list[dict[str, Any]],
    training: dict[str, Any],
    comparison: list[dict[str, Any]],
    out: str,
) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 8.4))
    ax, ax2, ax3 = axes[0]
    styles = {
        "revnet.while_loop": "o-",
        "revnet.scan": "x--",
        "lax.scan": "s-",
        "checkpointed lax.scan": "^-",
    }
    for method in METHODS:
        pts = [
            (r["steps"], r["temp_bytes"] / common.MIB)
            for r in rows
            if r["method"] == method
        ]
        xs, ys = zip(*pts)
        ax.plot(xs, ys, styles[method], label=method)
    common.log_axes(
        ax,
        "leapfrog steps",
        "compiled temp memory of jit(grad) [MiB]",
        "Backward memory vs number of steps",
    )
    ax.legend()
    ax2.plot(np.arange(len(training["losses"])), training["losses"], "o-", markersize=3)
    ax2.set_yscale("log")
    ax2.set_xlabel("optax (adam) step")
    ax2.set_ylabel("MSE of final (q, p)")
    ax2.set_title("Training through revnet.while_loop")
    ax2.grid(True, which="both", alpha=0.3)
    for body, marker in zip(loop_compare.BODIES, "osx"):
        for method, line in (("revnet", "-"), ("checkpointed lax.scan", ":")):
            pts = [
                (r["max_steps"], r["body_evaluations"])
                for r in comparison
                if r["sweep"] == "max_steps"
                and r["body"] == body
                and r["method"] == method
            ]
            if pts:
                xs, ys = zip(*pts)
                ax3.plot(xs, ys, marker + line, label=f"{method}, {body}")
    common.log_axes(
        ax3,
        "max_steps (steps taken fixed)",
        "body evaluations per gradient",
        "Cost follows steps taken, not max_steps",
    )
    ax3.legend(fontsize=7)
    loop_compare.plot_axes(axes[1], comparison)
    fig.tight_layout()
    return common.save_figure(fig, out, "loops")


# ------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = common.make_parser("python -m experiments.loops", DESCRIPTION)
    parser.add_argument(
        "--steps",
        type=common.int_list,
        default=None,
        help="comma-separated step counts for the memory sweep "
        f"(default: {','.join(map(str, STEPS_QUICK))} quick, "
        f"{','.join(map(str, STEPS_FULL))} otherwise)",
    )
    parser.add_argument(
        "--batch",
        type=common.positive_int,
        default=None,
        help="trajectories per batch (default: 64 quick, 256)",
    )
    parser.add_argument(
        "--width",
        type=common.positive_int,
        default=32,
        help="hidden width of the potential's MLP (default: 32)",
    )
    parser.add_argument(
        "--dt",
        type=common.positive_float,
        default=0.05,
        help="leapfrog step size (default: 0.05)",
    )
    parser.add_argument(
        "--t-min",
        type=common.positive_float,
        default=1.0,
        help="shortest trajectory end time (default: 1.0)",
    )
    parser.add_argument(
        "--t-max",
        type=common.positive_float,
        default=3.0,
        help="longest trajectory end time (default: 3.0)",
    )
    parser.add_argument(
        "--train-steps",
        type=common.positive_int,
        default=None,
        help="optax steps (default: 20 quick, 200 otherwise)",
    )
    parser.add_argument(
        "--lr",
        type=common.positive_float,
        default=3e-3,
        help="adam learning rate (default: 3e-3)",
    )
    parser.add_argument(
        "--compare-steps",
        type=common.int_list,
        default=None,
        help="comma-separated steps taken for the three-body comparison, with "
        "max_steps equal to them (default: "
        f"{','.join(map(str, COMPARE_STEPS))}; tiny "
        f"{','.join(map(str, COMPARE_STEPS_TINY))})",
    )
    parser.add_argument(
        "--compare-max-steps",
        type=common.int_list,
        default=None,
        help="comma-separated max_steps for the comparison, each with a quarter "
        "of the smallest as the steps taken (default: "
        f"{','.join(map(str, COMPARE_MAX_STEPS))}; tiny "
        f"{','.join(map(str, COMPARE_MAX_STEPS_TINY))})",
    )
    parser.add_argument(
        "--repeats",
        type=common.positive_int,
        default=None,
        help="timed repeats per comparison point (default: 3 tiny, 7)",
    )
    parser.add_argument(
        "--seed", type=common.seed_int, default=0, help="random seed (default: 0)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = common.parse_args(parser, argv)
    if args.t_min > args.t_max:
        parser.error(
            f"argument --t-min: expected at most --t-max ({args.t_max}), "
            f"got {args.t_min}"
        )
    if args.steps is None:
        args.steps = (
            STEPS_TINY if args.tiny else STEPS_QUICK if args.quick else STEPS_FULL
        )
    if args.batch is None:
        args.batch = 16 if args.tiny else 64 if args.quick else 256
    if args.train_steps is None:
        args.train_steps = 3 if args.tiny else 20 if args.quick else 200
    if args.compare_steps is None:
        args.compare_steps = COMPARE_STEPS_TINY if args.tiny else COMPARE_STEPS
    if args.compare_max_steps is None:
        args.compare_max_steps = (
            COMPARE_MAX_STEPS_TINY if args.tiny else COMPARE_MAX_STEPS
        )
    if args.repeats is None:
        args.repeats = 3 if args.tiny else 7

    print(
        f"training: batch {args.batch}, end times in [{args.t_min}, "
        f"{args.t_max}], dt {args.dt}",
        flush=True,
    )
    training = train(args)
    print(
        f"  loss {training['initial_loss']:.4g} -> {training['final_loss']:.4g}; "
        f"steps per trajectory {min(training['steps_per_trajectory'])}.."
        f"{max(training['steps_per_trajectory'])}; gradient vs lax.scan: max rel "
        f"err {training['gradient_check']['max_rel_error_vs_lax_scan']:.2g}",
        flush=True,
    )
    print("memory sweep:", flush=True)
    rows = measure(args, args.steps)
    base = {r["steps"]: r for r in rows if r["method"] == "lax.scan"}
    for r in rows:
        r["flops_ratio_to_lax_scan"] = r["flops"] / base[r["steps"]]["flops"]
    fixed = max(1, min(args.compare_max_steps) // 4)
    print(
        f"three bodies, four ways (width {args.width}, batch {args.batch}; "
        f"max_steps sweep at {fixed} steps taken):",
        flush=True,
    )
    comparison = loop_compare.compare(
        args.compare_steps,
        args.compare_max_steps,
        fixed,
        args.width,
        args.batch,
        args.repeats,
        args.seed,
        log=lambda line: print(line, flush=True),
    )
    config = {k: v for k, v in vars(args).items() if k != "out"}
    config["methods"] = list(METHODS)
    config["potential"] = "|q|^2/2 + tanh MLP; data from Henon-Heiles"
    config["comparison_methods"] = list(loop_compare.METHODS)
    config["comparison_steps_taken_in_max_steps_sweep"] = fixed
    path = common.write_json(
        args.out,
        "loops",
        config,
        {"training": training, "sweep": rows, "comparison": comparison},
    )
    png = plot(rows, training, comparison, args.out)
    print(f"wrote {path} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
