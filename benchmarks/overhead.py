"""Overhead of ``@revnet.invertible`` against a hand-written ``jax.custom_vjp``.

One stack of additive couplings (MLP residual functions, weights as a pytree: a
short unrolled chain of blocks, then a ``lax.scan`` over stacked weights) is
written twice and checked against plain ``jax.grad`` of the unwrapped function:

* **invertible**: the plain function under ``revnet.invertible`` (applied to a
  closure over the weights at each call, as a Haiku model does);
* **hand**: a hand-written ``jax.custom_vjp`` whose forward saves only the
  output and whose backward is a reverse ``lax.scan`` that rebuilds each block's
  input and takes the VJP of that same evaluation (the fused RevNet backward).

Reported, as medians over interleaved rounds after warm-up, and as ratios
invertible / hand: time to trace ``jit(grad)`` (``jax.make_jaxpr``), the first
call of a fresh ``jit(grad)`` (trace, analysis, lowering, compilation, run),
lowering and compilation separately, a warm jitted call, warm eager (un-jitted)
calls of the forward and of ``jax.grad``; compiled temp memory and FLOPs
(plain backprop as a reference); the compile time at two depths (flat in depth:
the stack is a scan); and the number of analyses per warm eager call.

    python -m benchmarks.overhead [--quick | --tiny] [--out results]
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core

import revnet
from benchmarks import measure

NAME = "overhead"
METHODS = ("invertible", "hand")
# Relative error of gradients vs plain jax.grad, against each leaf's largest
# value (reversible float32 gradients differ by 1e-7..4e-6).
GRAD_RTOL = {"float32": 2e-5, "float64": 1e-10}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The measured stack and how long to measure it.

    Attributes:
      width: Features, split into two halves.
      batch: Rows of the input.
      depth: Scanned blocks of the measured stack.
      repeats: Timed rounds (half of them at each of ``depths``).
      unrolled: Blocks chained before the scan, without a loop.
      depths: Two depths whose compile times are compared.
      eager_calls: Warm eager calls over which analyses are counted.
    """

    width: int = 256
    batch: int = 128
    depth: int = 16
    repeats: int = 15
    unrolled: int = 2
    depths: tuple[int, int] = (4, 32)
    eager_calls: int = 3


SIZES = {
    "full": Sizes(),
    "quick": Sizes(width=128, batch=64, depth=8, repeats=7),
    "tiny": Sizes(width=16, batch=8, depth=4, repeats=1, eager_calls=1),
}

Params = Any


def _analysis_count() -> int | None:
    """Total number of analyses the engine has run so far (its statistics)."""
    from revnet._engine import stats

    return stats["analyses"]


# --------------------------------------------------------------------------- model


def init_params(key: jax.Array, depth: int, unrolled: int, width: int) -> Params:
    """Weights of ``unrolled`` chained blocks and ``depth`` scanned blocks."""
    half = width // 2

    def block(key, lead=()):
        kf, kg = jax.random.split(key)
        scale = 1.0 / np.sqrt(half)
        return {
            name: {
                "w": scale * jax.random.normal(k, (*lead, half, half)),
                "b": jnp.zeros((*lead, half)),
            }
            for name, k in (("f", kf), ("g", kg))
        }

    keys = jax.random.split(key, unrolled + 1)
    return {
        "chain": [block(k) for k in keys[:unrolled]],
        "scan": block(keys[-1], (depth,)),
    }


def _mlp(p: Params, h: jax.Array) -> jax.Array:
    return jnp.tanh(h @ p["w"] + p["b"])


def block(p: Params, h: jax.Array) -> jax.Array:
    """One additive coupling: ``y1 = h1 + F(h2)``, ``y2 = h2 + G(y1)``."""
    h1, h2 = jnp.split(h, 2, axis=-1)
    y1 = h1 + _mlp(p["f"], h2)
    y2 = h2 + _mlp(p["g"], y1)
    return jnp.concatenate([y1, y2], axis=-1)


def stack(params: Params, x: jax.Array) -> jax.Array:
    """The plain function: the unrolled chain, then a scan over stacked weights."""
    for p in params["chain"]:
        x = block(p, x)
    return lax.scan(lambda h, p: (block(p, h), None), x, params["scan"])[0]


def block_backward(p: Params, y: jax.Array, gy: jax.Array):
    """Rebuilds a block's input from its output, fused with the block's VJP.

    Returns ``(x, gx, gp)``: the input, its cotangent and the weights'.
    """
    y1, y2 = jnp.split(y, 2, axis=-1)
    g1, g2 = jnp.split(gy, 2, axis=-1)
    g_out, g_vjp = jax.vjp(_mlp, p["g"], y1)
    h2 = y2 - g_out
    gp_g, gy1 = g_vjp(g2)
    g1 = g1 + gy1
    f_out, f_vjp = jax.vjp(_mlp, p["f"], h2)
    h1 = y1 - f_out
    gp_f, gh2 = f_vjp(g1)
    x = jnp.concatenate([h1, h2], axis=-1)
    gx = jnp.concatenate([g1, g2 + gh2], axis=-1)
    return x, gx, {"f": gp_f, "g": gp_g}


@jax.custom_vjp
def hand_stack(params: Params, x: jax.Array) -> jax.Array:
    """``stack`` with a hand-written fused reversible backward pass."""
    return stack(params, x)


def _hand_fwd(params, x):
    y = stack(params, x)
    return y, (params, y)


def _hand_bwd(res, gy):
    params, y = res

    def step(carry, p):
        x, gx, gp = block_backward(p, *carry)
        return (x, gx), gp

    (y, gy), g_scan = lax.scan(step, (y, gy), params["scan"], reverse=True)
    g_chain = []
    for p in reversed(params["chain"]):
        y, gy, gp = block_backward(p, y, gy)
        g_chain.insert(0, gp)
    return {"chain": g_chain, "scan": g_scan}, gy


hand_stack.defvjp(_hand_fwd, _hand_bwd)


def invertible_stack(params: Params, x: jax.Array) -> jax.Array:
    """``stack`` under ``revnet.invertible``, closing over the weights."""
    return revnet.invertible(lambda h: stack(params, h))(x)


FORWARDS: dict[str, Callable[[Params, jax.Array], jax.Array]] = {
    "invertible": invertible_stack,
    "hand": hand_stack,
    "standard": stack,
}


def loss_of(method: str) -> Callable[[Params, jax.Array], jax.Array]:
    """The scalar loss ``0.5 * mean(y**2)`` of one method's forward."""
    forward = FORWARDS[method]
    return lambda params, x: 0.5 * jnp.mean(forward(params, x) ** 2)


def grad_of(method: str) -> Callable[..., Any]:
    """``jax.grad`` of the loss in the weights and the input."""
    return jax.grad(loss_of(method), argnums=(0, 1))


# --------------------------------------------------------------------- checking


def _max_rel_error(got: Any, want: Any) -> float:
    """On the host, in the leaves' dtype: no small program compiled per shape."""
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    return max(
        float(np.max(np.abs(g - w)) / max(float(np.max(np.abs(w))), 1e-30))
        for g, w in ((np.asarray(g), np.asarray(w)) for g, w in pairs)
    )


def gradient_check(args: Sizes) -> dict[str, Any]:
    """Values and gradients of both methods vs plain ``jax.grad``, per dtype.

    Each leaf's largest error is taken relative to that leaf's largest value.
    """
    out: dict[str, Any] = {}
    for dtype, rtol in GRAD_RTOL.items():
        with jax.enable_x64(dtype == "float64"):
            params, x = make_inputs(args, args.depth, dtype)
            runs = {
                m: jax.jit(lambda p, x, m=m: (FORWARDS[m](p, x), grad_of(m)(p, x)))(
                    params, x
                )
                for m in (*METHODS, "standard")
            }
            want_y, want_g = runs["standard"]
            row: dict[str, Any] = {"rtol": rtol}
            for method in METHODS:
                y, g = runs[method]
                row[method] = {
                    "value_rel_error": _max_rel_error(y, want_y),
                    "grad_rel_error": _max_rel_error(g, want_g),
                }
            row["passed"] = all(
                row[m]["value_rel_error"] <= rtol and row[m]["grad_rel_error"] <= rtol
                for m in METHODS
            )
            out[dtype] = row
    out["passed"] = all(out[d]["passed"] for d in GRAD_RTOL)
    return out


def make_inputs(args: Sizes, depth: int, dtype: str = "float32"):
    """Weights and an input batch for ``depth`` scanned blocks, in ``dtype``."""
    kp, kx = jax.random.split(jax.random.PRNGKey(0))
    params = init_params(kp, depth, args.unrolled, args.width)
    x = jax.random.normal(kx, (args.batch, args.width))
    return jax.tree_util.tree_map(lambda a: a.astype(dtype), (params, x))


# ------------------------------------------------------------------- measuring


def phase_times(
    fns: dict[str, Callable[[], dict[str, float]]], repeats: int
) -> dict[str, dict[str, dict[str, float]]]:
    """Interleaved rounds (after one warm-up) of callables timing their phases.

    Each callable returns ``{phase: seconds}``; the result is
    ``{name: {phase: measure.summarize(samples)}}``.
    """
    for fn in fns.values():
        fn()
    samples: dict[str, dict[str, list[float]]] = {n: {} for n in fns}
    for _, name in measure.rounds(list(fns), repeats):
        for phase, s in fns[name]().items():
            samples[name].setdefault(phase, []).append(s)
    return {
        name: {phase: measure.summarize(s) for phase, s in phases.items()}
        for name, phases in samples.items()
    }


def _fresh(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A new function object, so that no JAX trace or compile cache is hit."""
    return lambda *a: fn(*a)


def _compile_phases(method: str, params, x) -> Callable[[], dict[str, float]]:
    """Times tracing, lowering, compiling and the first call of a fresh jit."""

    def run() -> dict[str, float]:
        grad = grad_of(method)
        t0 = time.perf_counter()
        jax.make_jaxpr(_fresh(grad))(params, x)
        t1 = time.perf_counter()
        lowered = jax.jit(_fresh(grad)).lower(params, x)
        t2 = time.perf_counter()
        lowered.compile()
        t3 = time.perf_counter()
        jax.block_until_ready(jax.jit(_fresh(grad))(params, x))
        t4 = time.perf_counter()
        return {
            "trace_s": t1 - t0,
            "lower_s": t2 - t1,
            "compile_s": t3 - t2,
            "first_call_s": t4 - t3,
        }

    return run


@contextlib.contextmanager
def count_jaxpr_prints() -> Iterator[list[int]]:
    """Counts ``str()`` of any jaxpr (pretty-printing) inside the block."""
    counter = [0]
    classes = {jex_core.Jaxpr, jex_core.ClosedJaxpr}
    saved = {cls: cls.__dict__.get("__str__") for cls in classes}

    def wrap(original):
        def counting_str(self):
            counter[0] += 1
            return original(self)

        return counting_str

    try:
        for cls in classes:
            cls.__str__ = wrap(cls.__str__)
        yield counter
    finally:
        for cls, original in saved.items():
            if original is None:
                del cls.__str__
            else:
                cls.__str__ = original


def eager_counts(params, x, calls: int) -> dict[str, Any]:
    """Analyses and jaxpr prints per warm eager call of the invertible stack."""
    grad = grad_of("invertible")
    jax.block_until_ready((invertible_stack(params, x), grad(params, x)))
    before = _analysis_count()
    with count_jaxpr_prints() as prints:
        for _ in range(calls):
            jax.block_until_ready(invertible_stack(params, x))
            jax.block_until_ready(grad(params, x))
    after = _analysis_count()
    analyses = None if before is None or after is None else (after - before) / calls
    return {
        "calls": calls,
        "analysis_count_available": before is not None,
        "analyses_per_warm_eager_call": analyses,
        "jaxpr_prints_per_warm_eager_call": prints[0] / calls,
    }


def _ratios(times: dict[str, dict[str, dict[str, float]]]) -> dict[str, float]:
    inv, hand = times["invertible"], times["hand"]
    return {phase: inv[phase]["median_s"] / hand[phase]["median_s"] for phase in inv}


def depth_scaling(args: Sizes) -> dict[str, Any]:
    """Trace + lowering + compile time, temp memory and FLOPs at two depths.

    Each sample is one ``measure.compile_stats`` of a fresh ``jit(grad)``, in
    alternating rounds over depths and methods (the process is already warm).
    """
    inputs = {d: make_inputs(args, d) for d in args.depths}
    samples: dict[tuple[int, str], list[float]] = {}
    stats: dict[tuple[int, str], dict[str, float]] = {}
    for r in range(max(1, args.repeats // 2)):
        for depth in args.depths:
            for method in METHODS[r % 2 :] + METHODS[: r % 2]:
                _, st = measure.compile_stats(_fresh(grad_of(method)), *inputs[depth])
                samples.setdefault((depth, method), []).append(st["compile_s"])
                stats[depth, method] = st
    rows = [
        {
            "depth": d,
            "method": m,
            "temp_bytes": stats[d, m]["temp_bytes"],
            "flops": stats[d, m]["flops"],
            "lower_compile_median_s": float(np.median(s)),
            "repeats": len(s),
        }
        for (d, m), s in samples.items()
    ]
    by = {(r["depth"], r["method"]): r for r in rows}
    lo, hi = min(args.depths), max(args.depths)
    return {
        "depths": [lo, hi],
        "rows": rows,
        "deep_over_shallow": {
            m: {
                key: by[hi, m][key] / max(by[lo, m][key], 1e-30)
                for key in ("lower_compile_median_s", "temp_bytes")
            }
            for m in METHODS
        },
    }


def measure_all(args: Sizes) -> dict[str, Any]:
    """Every timing, memory and FLOP figure; see the module docstring."""
    params, x = make_inputs(args, args.depth)
    results: dict[str, Any] = {}
    start = time.perf_counter()

    def log(what: str) -> None:
        print(f"[overhead] {time.perf_counter() - start:6.1f} s: {what}", flush=True)

    log("trace / lower / compile / first call")
    compile_times = phase_times(
        {m: _compile_phases(m, params, x) for m in METHODS}, args.repeats
    )

    log("warm calls")
    calls: dict[str, Callable[[], Any]] = {}
    for m in METHODS:
        jitted, grad, forward = jax.jit(grad_of(m)), grad_of(m), FORWARDS[m]
        calls[f"{m}/jit_grad_s"] = lambda f=jitted: f(params, x)
        calls[f"{m}/eager_forward_s"] = lambda f=forward: f(params, x)
        calls[f"{m}/eager_grad_s"] = lambda f=grad: f(params, x)
    warm = measure.median_times(calls, repeats=args.repeats, warmup=1)
    timings = {m: dict(compile_times[m]) for m in METHODS}
    for key, t in warm.items():
        method, measure_name = key.split("/")
        timings[method][measure_name] = t
    results["timings"] = timings
    results["time_ratio"] = _ratios(timings)

    log(f"compile time at depths {args.depths}")
    results["depth_scaling"] = depth_scaling(args)

    log("compiled memory and FLOPs")
    compiled = {}
    scaled = {(r["depth"], r["method"]): r for r in results["depth_scaling"]["rows"]}
    for method in (*METHODS, "standard"):
        stats = scaled.get((args.depth, method))  # the same program, compiled there
        if stats is None:
            _, stats = measure.compile_stats(grad_of(method), params, x)
        compiled[method] = {k: stats[k] for k in ("temp_bytes", "flops")}
    compiled["ratio"] = {
        k: compiled["invertible"][k] / compiled["hand"][k]
        for k in ("temp_bytes", "flops")
    }
    compiled["flops_over_standard"] = {
        m: compiled[m]["flops"] / compiled["standard"]["flops"] for m in METHODS
    }
    results["compiled"] = compiled

    log("warm eager calls: analyses and jaxpr prints")
    results["eager_cache"] = eager_counts(params, x, args.eager_calls)
    log("done")
    return results


def main(argv: Sequence[str] | None = None) -> dict:
    """Measures with run-time checks off; writes ``<out>/overhead.json``."""
    args = measure.parse(__doc__, argv)
    size = args.size
    sizes = SIZES[size]
    revnet.set_runtime_checks(False)  # the default configuration
    try:
        results = {"size": size, "config": dataclasses.asdict(sizes)}
        results["gradient_check"] = gradient_check(sizes)
        results.update(measure_all(sizes))
    finally:
        revnet.set_runtime_checks(None)
    measure.write_json(args.out, NAME, results)
    if not results["gradient_check"]["passed"]:
        raise SystemExit("overhead: gradients differ from jax.grad")
    return results


def markdown(results: dict, out: str) -> str:
    """A short table of the figures, ratios invertible / hand.

    A ratio of two single timings (``--tiny``: one round of each, one compile
    at each depth) is left out (—), and the text says so.
    """
    t, c, config = results["timings"], results["compiled"], results["config"]
    single = config["repeats"] < 2  # --tiny: one timing of each
    rows = []
    for key, label in (
        ("trace_s", "trace `jit(grad)` (make_jaxpr)"),
        ("first_call_s", "first call of a fresh `jit(grad)`"),
        ("lower_s", "lowering (incl. trace)"),
        ("compile_s", "XLA compile"),
        ("jit_grad_s", "warm jitted `grad` call"),
        ("eager_forward_s", "warm eager forward"),
        ("eager_grad_s", "warm eager `grad`"),
    ):
        a, b = t["invertible"][key]["median_s"], t["hand"][key]["median_s"]
        ratio = None if single else a / b  # a ratio of two single timings: left out
        rows.append([label, f"{a * 1e3:.2f} ms", f"{b * 1e3:.2f} ms", ratio])
    for key, label, scale, unit in (
        ("temp_bytes", "compiled temp memory", 1 / measure.MIB, "MiB"),
        ("flops", "FLOPs (scan body once)", 1e-6, "MFLOP"),
    ):
        a, b = c["invertible"][key] * scale, c["hand"][key] * scale
        rows.append([label, f"{a:.3f} {unit}", f"{b:.3f} {unit}", c["ratio"][key]])
    ds, e = results["depth_scaling"], results["eager_cache"]
    g = results["gradient_check"]
    lo, hi = ds["depths"]
    once = any(r["repeats"] < 2 for r in ds["rows"])  # one compile at each depth
    keys = ["temp_bytes"] if once else ["lower_compile_median_s", "temp_bytes"]
    scaling = "; ".join(
        f"{m} " + ", ".join(f"{v[k]:.2f}x" for k in keys)
        for m, v in ds["deep_over_shallow"].items()
    )
    scaled = "temp memory" if once else "(trace + lowering + compile) and temp memory"
    errors = ", ".join(
        f"{d} max rel error {max(g[d][m]['grad_rel_error'] for m in METHODS):.1e}"
        for d in GRAD_RTOL
    )
    return "\n\n".join(
        [
            "## `@invertible` overhead vs a hand-written `jax.custom_vjp`",
            f"Coupling stack: width {config['width']}, batch {config['batch']}, "
            f"{config['unrolled']} unrolled + {config['depth']} scanned blocks; "
            f"medians of {config['repeats']} interleaved rounds."
            + (
                " **Tiny run: single timings, so their ratios are left out (—).**"
                if single
                else ""
            ),
            measure.table(["measure", "invertible", "hand-written", "ratio"], rows),
            f"Depth {lo} -> {hi}, {scaled}, deep / shallow: {scaling}"
            + (
                " (one compile at each depth: its time ratio is left out)"
                if once
                else ""
            )
            + ". Warm eager calls: "
            f"{e['analyses_per_warm_eager_call']} analyses and "
            f"{e['jaxpr_prints_per_warm_eager_call']:g} jaxpr prints per call. "
            f"Gradients vs plain `jax.grad`: {errors}"
            + (" (passed)." if g["passed"] else " (FAILED)."),
        ]
    )


if __name__ == "__main__":
    main()
