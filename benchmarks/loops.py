"""Loops: backward memory and FLOPs vs steps, and three bodies four ways.

**Steps sweep.** A particle moves in a 2-D potential ``V(q) = |q|^2/2 +
MLP(q)`` integrated with leapfrog (kick-drift-kick, invertible step by step).
For a growing number of steps, the compiled memory
(``memory_analysis().temp_size_in_bytes``) and FLOPs (``cost_analysis``) of
``jit(grad(loss))`` are measured for ``revnet.while_loop``, ``revnet.scan``,
plain ``lax.scan`` and ``lax.scan`` over a ``jax.checkpoint``-ed step.

**Comparison.** Three bodies (closed-over weights ``W``, ``b``; the carry holds
a batch): ``invertible`` (leapfrog with force ``tanh(q W + b)``), ``partly
invertible`` (the same, plus a running maximum of ``|q|`` per trajectory) and
``not invertible`` (a damped map ``z -> (1 - g) z + dt tanh(z W + b)``), each
differentiated for ``n`` steps under a bound ``max_steps`` four ways:
``revnet`` (``revnet.while_loop`` in its automatic mode: invert, store,
checkpoint respectively), ``revnet checkpoint`` (forced checkpointing),
``checkpointed lax.scan`` (``max_steps`` steps of a ``jax.checkpoint``-ed body
that stops changing the carry after ``n``: what a JAX user writes today) and
``unrolled`` (a Python loop, plain backprop, up to :data:`UNROLL_MAX` steps).
Measured per gradient: compiled temp memory, body evaluations (forward,
recomputed and inverted, counted by a host callback in a separately compiled
copy; see :func:`counter`) and the median step time, against ``n`` (with
``max_steps = n``) and against ``max_steps`` (with ``n`` fixed). The step count
is an argument of the compiled program, so one program per (body, method,
``max_steps``) serves every ``n``.

    python -m benchmarks.loops [--quick | --tiny] [--out results]
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks import measure
from revnet.loops import scan, while_loop

NAME = "loops"
STEPS = {
    "tiny": [8, 64],
    "quick": [16, 128, 1024],
    "full": [8, 32, 128, 512, 2048, 8192],
}
COMPARE_STEPS = {"tiny": [16], "quick": [16, 64, 256, 1024, 4096]}
COMPARE_MAX_STEPS = {"tiny": [64, 256], "quick": [256, 1024, 4096, 16384]}
METHODS = ("revnet.while_loop", "revnet.scan", "lax.scan", "checkpointed lax.scan")
WIDTH = 32

Params = Any


def loop(cond, body, carry, max_steps: int, checkpoint: bool = False):
    """``revnet.while_loop`` in its automatic mode, or forced to checkpoint."""
    mode = "checkpoint" if checkpoint else "auto"
    return while_loop(cond, body, carry, max_steps=max_steps, mode=mode)


def _example() -> Any:
    """``examples/while_loop.py`` as a module: the sweep measures its model."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "examples", "while_loop.py")
    spec = importlib.util.spec_from_file_location("_while_loop_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The learned potential ``|q|^2/2 + MLP(q)`` and its parameters.
_EXAMPLE = _example()
init_mlp, potential = _EXAMPLE.init_mlp, _EXAMPLE.potential


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

        q, p, _ = loop(lambda c: c[2] < n, body, (q0, p0, 0), n)
        return q, p
    f = _scan_step(params, dt)
    if method == "revnet.scan":
        return scan(f, (q0, p0), None, length=n)[0]
    if method == "lax.scan":
        return lax.scan(f, (q0, p0), None, length=n)[0]
    if method == "checkpointed lax.scan":
        return lax.scan(jax.checkpoint(f), (q0, p0), None, length=n)[0]
    raise ValueError(f"unknown method {method!r}")


def steps_sweep(
    steps: Sequence[int], width: int, batch: int, seed: int = 0, dt: float = 0.05
) -> list[dict[str, Any]]:
    """Compiled memory and FLOPs of ``jit(grad(loss))`` per method and steps."""
    params = init_mlp(jax.random.PRNGKey(seed), width)
    key_q, key_p = jax.random.split(jax.random.PRNGKey(seed + 1))
    q0 = 0.3 * jax.random.normal(key_q, (batch, 2))
    p0 = 0.3 * jax.random.normal(key_p, (batch, 2))
    rows = []
    for n in steps:
        for method in METHODS:

            def loss(params, q0, p0, method=method, n=n):
                q, p = integrate_fixed(method, params, q0, p0, n, dt)
                return jnp.mean(q**2) + jnp.mean(p**2)

            _, stats = measure.compile_stats(jax.grad(loss), params, q0, p0)
            rows.append({"method": method, "steps": n, **stats})
            print(
                f"  {method:>22} steps {n:5d}: temp "
                f"{stats['temp_bytes'] / measure.MIB:9.3f} MiB, flops "
                f"{stats['flops']:.3g}",
                flush=True,
            )
    return rows


BODIES = ("invertible", "partly invertible", "not invertible")
COMPARE_METHODS = ("revnet", "revnet checkpoint", "checkpointed lax.scan", "unrolled")
UNROLL_MAX = 256


def init(key: jax.Array, width: int, batch: int) -> tuple[dict, jax.Array]:
    """Weights and initial positions."""
    kw, kb, kq = jax.random.split(key, 3)
    params = {
        "w": jax.random.normal(kw, (width, width)) / np.sqrt(width),
        "b": 0.1 * jax.random.normal(kb, (width,)),
    }
    return params, 0.5 * jax.random.normal(kq, (batch, width))


def counter(count: list[int]) -> Callable[[Any, Any], Any]:
    """``touch(x, i)``: ``x`` plus a zero that a host callback returns, counting.

    The callback's result is part of the step's value, so every evaluation of
    the step runs it: the forward pass, a recomputation from a checkpoint
    (``jax.checkpoint``'s or revnet's) and the inverse that rebuilds ``x``
    (``x = x_new - zero``). It reads the step counter ``i`` only, so it needs
    no derivative and leaves the body invertible.
    """

    def host(i):
        count[0] += 1
        return np.zeros((), np.float32)

    def touch(x, i):
        zero = jax.pure_callback(host, jax.ShapeDtypeStruct((), jnp.float32), i)
        return x + zero.astype(x.dtype)

    return touch


def make_step(body: str, params: dict, touch: Callable[[Any, Any], Any] | None):
    """Step ``i`` of ``body`` on its carry (a tuple of arrays, without counter)."""
    dt, g = 0.05, 0.1

    def force(q):
        return jnp.tanh(q @ params["w"] + params["b"])

    def step(c, i):
        if touch is not None:
            c = (touch(c[0], i), *c[1:])
        if body == "not invertible":
            (z,) = c
            return ((1 - g) * z + dt * force(z),)
        q, p = c[0], c[1]
        p = p - 0.5 * dt * force(q)
        q = q + dt * p
        p = p - 0.5 * dt * force(q)
        if body == "invertible":
            return q, p
        return q, p, jnp.maximum(c[2], jnp.max(jnp.abs(q), axis=-1))

    return step


def initial_carry(body: str, q0: jax.Array) -> tuple:
    if body == "not invertible":
        return (q0,)
    if body == "invertible":
        return q0, jnp.zeros_like(q0)
    return q0, jnp.zeros_like(q0), jnp.zeros(q0.shape[0], q0.dtype)


def run_loop(method: str, step, carry: tuple, n: Any, max_steps: int) -> tuple:
    """The final carry after ``n`` steps (``n`` traced, except for unrolling)."""
    if method in ("revnet", "revnet checkpoint"):

        def body(s):
            return (*step(s[:-1], s[-1]), s[-1] + 1)

        checkpoint = method == "revnet checkpoint"
        out = loop(lambda s: s[-1] < n, body, (*carry, 0), max_steps, checkpoint)
        return out[:-1]
    if method == "checkpointed lax.scan":

        def f(s, _):
            c, i = s
            new = step(c, i)
            keep = i < n
            return (tuple(jnp.where(keep, a, b) for a, b in zip(new, c)), i + 1), None

        (c, _), _ = lax.scan(jax.checkpoint(f), (carry, 0), None, length=max_steps)
        return c
    if method == "unrolled":
        for i in range(int(n)):
            carry = step(carry, jnp.int32(i))
        return carry
    raise ValueError(f"unknown method {method!r}")


def gradient_fn(body: str, method: str, max_steps: int, touch=None, n_static=None):
    """``grad(loss)(params, q0, n)``: the loss reads every float of the carry."""

    def loss(params, q0, n):
        n = n if n_static is None else n_static
        step = make_step(body, params, touch)
        c = run_loop(method, step, initial_carry(body, q0), n, max_steps)
        return sum(jnp.mean(jnp.sin(a)) for a in c)

    return jax.grad(loss, argnums=(0, 1))


def applies(method: str, n: int) -> bool:
    return method != "unrolled" or n <= UNROLL_MAX


def measure_point(
    body: str,
    method: str,
    n: int,
    max_steps: int,
    params: dict,
    q0: jax.Array,
    repeats: int,
    programs: dict | None = None,
) -> dict[str, Any]:
    """Memory, body evaluations and median step time of one configuration.

    ``programs`` keeps both compiled programs per key: unrolling ignores
    ``max_steps``, so its points at one ``n`` share them (measured anew)."""
    n_static, steps = (n if method == "unrolled" else None), jnp.int32(n)
    key = (body, method, n_static, max_steps if n_static is None else None)
    programs = {} if programs is None else programs
    if key not in programs:
        fn = gradient_fn(body, method, max_steps, n_static=n_static)
        count = [0]
        touch = counter(count)
        counted = jax.jit(gradient_fn(body, method, max_steps, touch, n_static))
        programs[key] = (*measure.compile_stats(fn, params, q0, steps), counted, count)
    compiled, stats, counted, count = programs[key]
    count[0] = 0
    jax.block_until_ready(counted(params, q0, steps))
    jax.effects_barrier()
    times = measure.median_times({"step": lambda: compiled(params, q0, steps)}, repeats)
    return {
        "body": body,
        "method": method,
        "steps": n,
        "max_steps": max_steps,
        "temp_bytes": stats["temp_bytes"],
        "flops": stats["flops"],
        "body_evaluations": count[0],
        "evaluations_per_step": count[0] / max(n, 1),
        "median_s": times["step"]["median_s"],
    }


def compare(
    steps: Sequence[int],
    max_steps_sweep: Sequence[int],
    fixed_steps: int,
    width: int,
    batch: int,
    repeats: int,
    seed: int,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Both sweeps: ``n`` steps with ``max_steps = n``, then ``fixed_steps``
    steps under each ``max_steps`` of ``max_steps_sweep``."""
    params, q0 = init(jax.random.PRNGKey(seed), width, batch)
    rows, programs = [], {}
    points = [("steps", n, n) for n in steps]
    points += [("max_steps", fixed_steps, m) for m in max_steps_sweep]
    for sweep, n, m in points:
        for body in BODIES:
            for method in COMPARE_METHODS:
                if not applies(method, n):
                    continue
                row = measure_point(body, method, n, m, params, q0, repeats, programs)
                row["sweep"] = sweep
                rows.append(row)
                log(
                    f"  {body:>17} {method:>21} n {n:5d} max {m:6d}: temp "
                    f"{row['temp_bytes'] / measure.MIB:8.3f} MiB, "
                    f"{row['body_evaluations']:7d} evaluations, "
                    f"{row['median_s'] * 1e3:8.2f} ms"
                )
    return rows


def plot(sweep: list[dict], comparison: list[dict], out: str) -> str:
    """Memory vs steps; evaluations vs ``max_steps``; memory vs steps per body."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 5, figsize=(26, 4.4))

    def lines(ax, rows, x, y, key, styles, scale=1.0):
        series = []
        for label, (marker, ls) in styles.items():
            pts = [(r[x], r[y] / scale) for r in rows if key(r) == label]
            if pts:
                xs, ys = zip(*pts)
                series.append({"label": label, "x": xs, "y": ys})
                series[-1].update(marker=marker, ls=ls, color=f"C{len(series) - 1}")
        measure.plot_lines(ax, series, log_y=True)  # no series hides another
        # Below the axes: inside, a legend may cover points.
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2))

    styles = dict(zip(METHODS, (("o", "-"), ("x", "--"), ("s", "-"), ("^", "-"))))
    by_method = lambda r: r["method"]  # noqa: E731
    lines(axes[0], sweep, "steps", "temp_bytes", by_method, styles, measure.MIB)
    measure.log_axes(
        axes[0], "leapfrog steps", "temp of jit(grad) [MiB]", "Backward memory vs steps"
    )
    styles = {
        f"{m}, {b}": (mk, ln)
        for b, mk in zip(BODIES, "osx")
        for m, ln in (("revnet", "-"), ("checkpointed lax.scan", ":"))
    }
    rows = [r for r in comparison if r["sweep"] == "max_steps"]
    label = lambda r: f"{r['method']}, {r['body']}"  # noqa: E731
    lines(axes[1], rows, "max_steps", "body_evaluations", label, styles)
    measure.log_axes(
        axes[1],
        "max_steps (steps taken fixed)",
        "body evaluations per gradient",
        "Cost follows steps taken, not max_steps",
    )
    styles = dict(
        zip(COMPARE_METHODS, (("o", "-"), ("x", "--"), ("^", "-"), ("s", ":")))
    )
    for ax, body in zip(axes[2:], BODIES):
        rows = [r for r in comparison if r["sweep"] == "steps" and r["body"] == body]
        lines(ax, rows, "steps", "temp_bytes", by_method, styles, measure.MIB)
        measure.log_axes(
            ax, "steps taken (= max_steps)", "temp of jit(grad) [MiB]", f"{body} body"
        )
    fig.tight_layout()
    return measure.save_figure(fig, out, NAME)


def main(argv: Sequence[str] | None = None) -> dict:
    """Runs both parts; writes ``<out>/loops.json`` and ``loops.png``."""
    args = measure.parse(__doc__, argv)
    size = args.size
    batch = 16 if args.tiny else 64 if args.quick else 256
    sweep = steps_sweep(STEPS[size], WIDTH, batch)
    base = {r["steps"]: r for r in sweep if r["method"] == "lax.scan"}
    for r in sweep:
        r["flops_ratio_to_lax_scan"] = r["flops"] / base[r["steps"]]["flops"]
    compare_size = "tiny" if args.tiny else "quick"
    maxes = COMPARE_MAX_STEPS[compare_size]
    fixed = max(1, min(maxes) // 4)
    repeats = 3 if args.tiny else 7
    comparison = compare(
        COMPARE_STEPS[compare_size], maxes, fixed, WIDTH, batch, repeats, 0
    )
    plot(sweep, comparison, args.out)
    results = {"size": size, "batch": batch, "width": WIDTH, "fixed_steps": fixed}
    return measure.write_json(
        args.out, NAME, {**results, "sweep": sweep, "comparison": comparison}
    )


LABELS = {
    "revnet": "revnet (auto)",
    "revnet checkpoint": "revnet, checkpointing",
    "checkpointed lax.scan": "`jax.checkpoint` + `lax.scan`",
    "unrolled": "unrolled backprop",
}


def markdown(results: dict, out: str) -> str:
    """The steps sweep and the comparison, one compact table each."""
    sweep = results["sweep"]
    steps = sorted({r["steps"] for r in sweep})
    by = {(r["method"], r["steps"]): r for r in sweep}
    table1 = measure.table(
        ["method"]
        + [f"temp MiB, {n} steps" for n in steps]
        + ["FLOPs / lax.scan (largest)"],
        [
            [m]
            + [by[m, n]["temp_bytes"] / measure.MIB for n in steps]
            + [by[m, steps[-1]]["flops_ratio_to_lax_scan"]]
            for m in METHODS
        ],
    )
    rows = results["comparison"]
    fixed = results["fixed_steps"]
    ns = sorted({r["steps"] for r in rows if r["sweep"] == "steps"})
    maxes = sorted({r["max_steps"] for r in rows if r["sweep"] == "max_steps"})
    points = [("steps", n, n) for n in ns] + [
        ("max_steps", fixed, maxes[0]),
        ("max_steps", fixed, maxes[-1]),
    ]
    got = {
        (r["body"], r["method"], r["sweep"], r["steps"], r["max_steps"]): r
        for r in rows
    }

    def cells(body, method, key, pts, scale=1.0):
        values = [got.get((body, method, *p)) for p in pts]
        return " / ".join("—" if r is None else f"{r[key] / scale:.4g}" for r in values)

    last = ("steps", ns[-1], ns[-1])
    table2 = []
    for body in BODIES:
        base = got.get((body, "checkpointed lax.scan", *last))
        for method, label in LABELS.items():
            r = got.get((body, method, *last))
            ratio = (
                None if r is None or base is None else r["median_s"] / base["median_s"]
            )
            table2.append(
                [body, label]
                + [
                    cells(body, method, "temp_bytes", pts, measure.MIB)
                    for pts in (points[: len(ns)], points[len(ns) :])
                ]
                + [
                    cells(body, method, "body_evaluations", pts)
                    for pts in (points[: len(ns)], points[len(ns) :])
                ]
                + [ratio]
            )
    n_text = " / ".join(map(str, ns))
    m_text = f"n = {fixed}, max_steps {maxes[0]} / {maxes[-1]}"
    head = ["body", "method", f"temp MiB, n = {n_text}", f"temp MiB, {m_text}"]
    head += [f"body evaluations, n = {n_text}", f"body evaluations, {m_text}"]
    head += [f"time / checkpointed scan's, n = {ns[-1]}"]
    return "\n\n".join(
        [
            "## Loops",
            "Compiled temp memory of `jit(grad)` of a leapfrog integrator against "
            "the number of steps, four ways (FLOPs count a loop body once):",
            f"![loops]({NAME}.png)",
            table1,
            "Three bodies (invertible leapfrog, leapfrog with a running maximum, a "
            "damped map) four ways: compiled temp memory, body evaluations per "
            "gradient (forward, recomputed and inverted, counted by a host "
            "callback) and median step time, against steps taken `n` "
            "(`max_steps = n`) and against `max_steps`.",
            measure.table(head, table2),
        ]
    )


if __name__ == "__main__":
    main()
