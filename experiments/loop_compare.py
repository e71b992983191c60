"""Loops over three kinds of body, four ways: memory, body evaluations, step time.

The bodies (closed-over weights ``W``, ``b``; the carry holds a batch):

* ``invertible``: leapfrog, ``(q, p)`` kick-drift-kick with force
  ``tanh(q W + b)``;
* ``partly invertible``: the same, plus a running maximum of ``|q|`` per
  trajectory (one float a trajectory a step cannot be rebuilt);
* ``not invertible``: a damped nonlinear map ``z -> (1 - g) z + dt tanh(z W +
  b)``.

Each is differentiated four ways, for ``n`` steps under a bound ``max_steps``:

* ``revnet``: ``revnet.while_loop`` in its automatic mode (invert, store,
  checkpoint respectively);
* ``revnet checkpoint``: ``revnet.while_loop(..., invert=False)``;
* ``checkpointed lax.scan``: ``lax.scan`` of ``max_steps`` steps over a
  ``jax.checkpoint``-ed body that stops changing the carry after ``n`` steps:
  what a JAX user writes today for a bounded while loop;
* ``unrolled``: a Python loop of ``n`` steps, plain backprop (up to
  :data:`UNROLL_MAX` steps).

Measured per gradient (``jit(grad(loss))``): compiled temp memory
(``memory_analysis``), body evaluations (forward, recomputed and inverted
together, counted by a host callback in a separately compiled copy; see
:func:`counter`) and the median step time. The step count is an argument of
the compiled program, so one program per (body, method, ``max_steps``) serves
every ``n``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from experiments import common
from revnet.loops import while_loop

BODIES = ("invertible", "partly invertible", "not invertible")
METHODS = ("revnet", "revnet checkpoint", "checkpointed lax.scan", "unrolled")
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

        out = while_loop(
            lambda s: s[-1] < n,
            body,
            (*carry, 0),
            max_steps=max_steps,
            mode="checkpoint" if method == "revnet checkpoint" else "auto",
        )
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
) -> dict[str, Any]:
    """Memory, body evaluations and median step time of one configuration."""
    n_static = n if method == "unrolled" else None
    fn = gradient_fn(body, method, max_steps, n_static=n_static)
    steps = jnp.int32(n)
    compiled, stats = common.compile_stats(fn, params, q0, steps)
    count = [0]
    counted = jax.jit(gradient_fn(body, method, max_steps, counter(count), n_static))
    jax.block_until_ready(counted(params, q0, steps))
    jax.effects_barrier()
    times = common.median_times({"step": lambda: compiled(params, q0, steps)}, repeats)
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
    rows = []
    points = [("steps", n, n) for n in steps]
    points += [("max_steps", fixed_steps, m) for m in max_steps_sweep]
    for sweep, n, m in points:
        for body in BODIES:
            for method in METHODS:
                if not applies(method, n):
                    continue
                row = measure_point(body, method, n, m, params, q0, repeats)
                row["sweep"] = sweep
                rows.append(row)
                log(
                    f"  {body:>17} {method:>21} n {n:5d} max {m:6d}: temp "
                    f"{row['temp_bytes'] / common.MIB:8.3f} MiB, "
                    f"{row['body_evaluations']:7d} evaluations, "
                    f"{row['median_s'] * 1e3:8.2f} ms"
                )
    return rows


def plot_axes(axes: Sequence[Any], rows: list[dict[str, Any]]) -> None:
    """Memory and evaluations against steps (``max_steps = n``), per body."""
    styles = {
        "revnet": "o-",
        "revnet checkpoint": "x--",
        "checkpointed lax.scan": "^-",
        "unrolled": "s:",
    }
    for ax, body in zip(axes, BODIES):
        for method in METHODS:
            pts = [
                (r["steps"], r["temp_bytes"] / common.MIB)
                for r in rows
                if r["sweep"] == "steps" and r["body"] == body and r["method"] == method
            ]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, styles[method], label=method)
        common.log_axes(
            ax,
            "steps taken (= max_steps)",
            "temp memory of jit(grad) [MiB]",
            f"{body} body",
        )
    axes[0].legend(fontsize=8)
