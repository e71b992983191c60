"""Exact mode (``AdditiveCoupling(f, g, exact=True)``) against float couplings.

Haiku ``ReversibleSequence`` stacks of additive couplings whose residual
functions are MLPs (random, non-identity parameters, the same for every mode):

* **Reconstruction** against depth, ``max |inverse(f(x)) - x|`` and whether
  it is bitwise 0, for plain float32 (the whole stack inverted), anchored
  float32 (each segment of ``anchor_every`` layers inverted from the exact
  activation after it, as the anchored backward pass rebuilds it) and exact
  mode. Every mode gets the same input, on the exact grid; depths up to
  10,000 run as the sequence's scan (one ``block_fn``, ``num_layers``), so
  compile time stays flat.
* **Cost per layer** of a realistic block (width 256, MLP residuals of width
  256): compiled FLOPs of ``jit(grad)`` of an unrolled stack (a list of
  blocks) of two layers less that of one (XLA counts a scan body once), exact
  against inexact (and standard backprop's, for scale); compiled temp memory
  and the median step time of ``jit(grad)`` of a scanned stack.
* **Training**: ``examples/digits.py``'s run (same data, seed, batches and
  steps) with ``RevNet(..., exact=False)`` and ``exact=True``: test accuracy
  of each.

    python -m benchmarks.exact [--quick | --tiny] [--out results]
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

from benchmarks import measure

NAME = "exact"
MODES = ("plain", "anchored", "exact")
DEPTHS = {
    "tiny": [1, 16],
    "quick": [1, 10, 100, 1000],
    "full": [1, 10, 100, 1000, 10000],
}
REPEATS = {"tiny": 3, "quick": 15, "full": 30}
# digits.py's flags per size: epochs of the real run, or its smoke run.
DIGITS = {
    "tiny": ["--smoke", "--epochs", "1"],
    "quick": ["--epochs", "3"],
    "full": ["--epochs", "10"],  # digits.py's default
}


@dataclasses.dataclass(frozen=True)
class Config:
    """Sizes.

    Attributes:
      width: Features of the reconstruction sweep's stream (even).
      hidden: Hidden units of its residual MLPs.
      batch: Rows of its input.
      anchor_every: The anchored mode's segment length.
      block_width: Features of the realistic block (cost per layer).
      block_hidden: Hidden units of its residual MLPs.
      block_batch: Rows of its input.
      time_depth: Depth of the scanned stack whose step is timed.
    """

    width: int = 32
    hidden: int = 32
    batch: int = 16
    anchor_every: int = 16
    block_width: int = 256
    block_hidden: int = 256
    block_batch: int = 64
    time_depth: int = 16


def block_fn(width: int, hidden: int, exact: bool):
    """One additive coupling whose residual functions are tanh MLPs."""
    import haiku as hk
    import jax.numpy as jnp

    from revnet.blocks import AdditiveCoupling

    half = width // 2

    def mlp(h):
        return hk.Linear(half)(jnp.tanh(hk.Linear(hidden)(h)))

    def block(h):
        return AdditiveCoupling(mlp, mlp, exact=exact)(h)

    return block


def stack(block, depth: int, reversible: bool = True, unrolled: bool = False):
    """``(forward, inverse)`` transforms of ``depth`` blocks: a scan, or with
    ``unrolled`` a list of blocks (one after another)."""
    import haiku as hk

    from revnet.blocks import ReversibleSequence

    def seq():
        if unrolled:
            return ReversibleSequence([block] * depth, reversible=reversible)
        return ReversibleSequence(block, depth, reversible)

    return (
        hk.without_apply_rng(hk.transform(lambda x: seq()(x))),
        hk.without_apply_rng(hk.transform(lambda y: seq().inverse(y))),
    )


def _max_abs(a: Any, b: Any) -> float:
    """``max |a - b|``; inf where any element is not finite."""
    import numpy as np

    diff = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
    return float(np.max(diff)) if np.all(np.isfinite(diff)) else float("inf")


@functools.cache
def _segment(width: int, hidden: int, n: int) -> tuple[Any, Any]:
    """Jitted float forward and inverse of ``n`` blocks."""
    import jax

    fwd, inv = stack(block_fn(width, hidden, False), n)
    return jax.jit(fwd.apply), jax.jit(inv.apply)


def anchored_error(args: Config, params: Any, x: Any, depth: int) -> float:
    """``max |rebuilt - stored|`` over the anchors of ``anchor_every``: the
    stack cut into segments, each inverted from the exact activation after it.
    The whole segments run as one scan forward and one ``vmap`` inverse."""
    import jax
    import jax.numpy as jnp

    k = args.anchor_every
    n, tail = divmod(depth, k)
    worst, h = 0.0, x
    if n:
        fwd, inv = _segment(args.width, args.hidden, k)
        segs = jax.tree.map(lambda a: a[: n * k].reshape(n, k, *a.shape[1:]), params)

        @jax.jit
        def run(segs, x):
            def body(h, p):
                return fwd(p, h), h

            last, before = jax.lax.scan(body, x, segs)
            after = jnp.concatenate([before[1:], last[None]])
            return last, before, jax.vmap(inv)(segs, after)

        h, before, rebuilt = run(segs, x)
        worst = _max_abs(rebuilt, before)
    if tail:
        fwd, inv = _segment(args.width, args.hidden, tail)
        rest = jax.tree.map(lambda a: a[n * k :], params)
        worst = max(worst, _max_abs(inv(rest, fwd(rest, h)), h))
    return worst


def reconstruction(args: Config, depth: int) -> list[dict[str, Any]]:
    """One row per mode at ``depth``: max error, bitwise 0, output size."""
    import jax
    import numpy as np

    import revnet

    x = jax.random.normal(jax.random.PRNGKey(1), (args.batch, args.width))
    x = revnet.exact.grid(x)  # one input, on the grid, for every mode
    rows, params, outputs = [], None, {}
    for mode in MODES:  # "plain" first: "anchored" inverts its forward
        if mode == "anchored":
            y = outputs["plain"]
            err, bitwise = anchored_error(args, params, x, depth), None
        else:
            block = block_fn(args.width, args.hidden, mode == "exact")
            fwd, inv = stack(block, depth)
            if params is None:  # the same parameters for every mode
                params = jax.jit(fwd.init)(jax.random.PRNGKey(0), x)
            y = outputs[mode] = jax.jit(fwd.apply)(params, x)
            back = np.asarray(jax.jit(inv.apply)(params, y))
            err, bitwise = _max_abs(back, x), bool(np.array_equal(back, x))
        row = {"mode": mode, "depth": depth, "max_abs_error": err}
        row |= {"bitwise_zero": err == 0.0 if bitwise is None else bitwise}
        row["output_max_abs"] = float(np.max(np.abs(np.asarray(y))))
        rows.append(row)
        print(
            f"[exact] depth {depth:5d} {mode:8s} max |x' - x| {err:.3e} "
            f"bitwise {row['bitwise_zero']}  max |y| {row['output_max_abs']:.3g}",
            flush=True,
        )
    return rows


def _grad_fn(forward):
    """``(params, x, c) -> grads`` of the linear functional ``sum(f(x) * c)``."""
    import jax
    import jax.numpy as jnp

    def loss(params, x, c):
        return jnp.sum(forward.apply(params, x) * c)

    return jax.grad(loss, argnums=(0, 1))


def cost(args: Config, repeats: int) -> dict[str, Any]:
    """FLOPs per layer, temp memory and step time, exact against inexact."""
    import jax

    import revnet

    w, hid, b = args.block_width, args.block_hidden, args.block_batch
    kx, kc = jax.random.split(jax.random.PRNGKey(2))
    x = revnet.exact.grid(jax.random.normal(kx, (b, w)))
    c = jax.random.normal(kc, (b, w))
    out: dict[str, Any] = {"coupling": {}}
    variants = {"inexact": (False, True), "exact": (True, True)}
    variants["standard backprop"] = (False, False)
    steps = {}
    for name, (exact, reversible) in variants.items():
        flops = {}
        for n in (1, 2):
            fwd, _ = stack(block_fn(w, hid, exact), n, reversible, unrolled=True)
            params = fwd.init(jax.random.PRNGKey(0), x)
            flops[n] = measure.compile_stats(_grad_fn(fwd), params, x, c)[1]["flops"]
        fwd, _ = stack(block_fn(w, hid, exact), args.time_depth, reversible)
        params = fwd.init(jax.random.PRNGKey(0), x)
        compiled, stats = measure.compile_stats(_grad_fn(fwd), params, x, c)
        steps[name] = functools.partial(compiled, params, x, c)
        out["coupling"][name] = {
            "flops_1_layer": flops[1],
            "flops_2_layers": flops[2],
            "flops_per_layer": flops[2] - flops[1],
            "temp_bytes": stats["temp_bytes"],
            "flops_scan": stats["flops"],
        }
    times = measure.median_times(steps, repeats)
    base = out["coupling"]["inexact"]
    for name, entry in out["coupling"].items():
        entry.update(times[name])
        entry["flops_vs_inexact"] = entry["flops_per_layer"] / base["flops_per_layer"]
        entry["temp_vs_inexact"] = entry["temp_bytes"] / base["temp_bytes"]
        entry["time_vs_inexact"] = entry["median_s"] / times["inexact"]["median_s"]
        spread = measure.ratio_spread(
            times[name]["samples_s"], times["inexact"]["samples_s"]
        )
        entry["time_vs_inexact_min"] = spread and spread["min"]
        entry["time_vs_inexact_max"] = spread and spread["max"]
        print(
            f"[exact] {name:17s} FLOPs/layer {entry['flops_per_layer']:.4g} "
            f"({entry['flops_vs_inexact']:.4f}x inexact)  temp "
            f"{entry['temp_bytes']:.0f} B  step {1e3 * entry['median_s']:.2f} ms",
            flush=True,
        )
    return out


def exact_revnet_fn(exact: bool):
    """digits.py's ``net_fn`` with ``RevNet(..., exact=exact)``."""
    from revnet.blocks import RevNet

    def net_fn(images, is_training, config, rev):
        net = RevNet(config, num_classes=10, reversible=rev, exact=exact)
        return net(images, is_training)

    return net_fn


def training(size: str) -> dict[str, Any]:
    """digits.py's run (same data, seed, batches and steps) with float and with
    exact couplings."""
    digits = measure.load_example_module("digits")
    out: dict[str, Any] = {"flags": DIGITS[size]}
    original = digits.net_fn
    try:
        for mode in ("float", "exact"):
            digits.net_fn = exact_revnet_fn(mode == "exact")
            print(f"[exact] digits.py {' '.join(DIGITS[size])}, {mode}", flush=True)
            out[mode] = digits.main(DIGITS[size])
    finally:
        digits.net_fn = original
    return out


def main(argv: Sequence[str] | None = None) -> dict:
    """Measures reconstruction, cost and training; writes ``exact.json``."""
    args = measure.parse(__doc__, argv)
    config = Config()
    rows = [r for depth in DEPTHS[args.size] for r in reconstruction(config, depth)]
    results = {"size": args.size, "config": dataclasses.asdict(config), "rows": rows}
    results["cost"] = cost(config, REPEATS[args.size])
    results["training"] = training(args.size)
    return measure.write_json(args.out, NAME, results)


def markdown(results: dict, out: str) -> str:
    """Reconstruction per depth and mode, cost per layer, training accuracy."""
    cfg = results["config"]
    by = {(r["mode"], r["depth"]): r for r in results["rows"]}
    depths = sorted({d for _, d in by})
    recon = [
        [d]
        + [by[m, d]["max_abs_error"] for m in MODES]
        + [by["exact", d]["bitwise_zero"], by["exact", d]["output_max_abs"]]
        for d in depths
    ]
    tiny = results["size"] == "tiny"
    cost_rows = []
    for name, c in results["cost"]["coupling"].items():
        row = [name, f"{c['flops_per_layer']:,.0f}", f"{c['flops_vs_inexact']:.4f}"]
        row += [f"{c['temp_bytes']:,.0f}", c["temp_vs_inexact"]]
        if tiny:
            row += ["—"] * 3
        else:
            row += [1e3 * c["median_s"], c["time_vs_inexact"]]
            row += [f"{c['time_vs_inexact_min']:.3g}–{c['time_vs_inexact_max']:.3g}"]
        cost_rows.append(row)
    train = results["training"]
    acc = []
    for mode in ("float", "exact"):
        history = train[mode]["history"]
        last, tail = history[-1], history[-3:]
        mean = sum(r["test_accuracy"]["reversible"] for r in tail) / len(tail)
        acc.append(
            [mode, last["epoch"], last["test_accuracy"]["reversible"], mean]
            + [last["test_accuracy"]["standard"], last["loss"]["reversible"]]
            + [last["grad_max_abs_diff"]]
        )
    return "\n\n".join(
        [
            "## Exact mode against float couplings",
            f"Reconstruction `max |inverse(f(x)) - x|` of a `ReversibleSequence` of "
            f"additive couplings (width {cfg['width']}, tanh MLP residuals of "
            f"{cfg['hidden']} hidden units, batch {cfg['batch']}, float32, the "
            "same parameters and grid input for every mode); anchored: "
            f"`anchor_every={cfg['anchor_every']}`, each segment rebuilt from "
            "the activation after it.",
            measure.table(
                ["depth", "plain float32", f"anchored (k={cfg['anchor_every']})"]
                + ["exact", "exact bitwise 0", "exact: max abs y"],
                recon,
            ),
            f"Cost of a coupling of width {cfg['block_width']} (MLP residuals of "
            f"{cfg['block_hidden']} hidden units, batch {cfg['block_batch']}): "
            "FLOPs per layer of `jit(grad)` (two unrolled layers less one); "
            f"temp memory and step time of `jit(grad)` of a {cfg['time_depth']}"
            "-layer scan (time: median, and the per-round ratio's min–max).",
            measure.table(
                ["coupling", "FLOPs / layer", "vs inexact", "temp bytes"]
                + ["temp vs inexact", "step ms", "time vs inexact", "min–max"],
                cost_rows,
            ),
            f"Training: `examples/digits.py {' '.join(train['flags'])}` (same "
            "seed, batches and steps) with `RevNet(..., exact=False)` and "
            "`exact=True`. Last epoch; one run each, so a few points of "
            "accuracy are noise:",
            measure.table(
                ["couplings", "epoch", "test acc. reversible", "its mean, last 3"]
                + ["test acc. standard", "loss reversible", "grad gap rev/std"],
                acc,
            ),
        ]
    )


if __name__ == "__main__":
    main()
