"""Reconstruction and gradient error of reversible stacks vs depth and dtype.

For additive couplings and three affine couplings (the default ``"sigmoid"``
scale, the ``"tanh"`` soft clamp of the log-scale and the unbounded ``"exp"``
scale), each stack (``ReversibleSequence``; affine blocks are followed by a
channel reversal so both halves get transformed) runs in float32, bfloat16
and float64 from the same random parameters (the affine nets' output layers
are not zero-initialised, so no block is the identity). Measured per depth:

* reconstruction error ``|inverse(f(x)) - x| / |x|`` (relative L2 norms),
* gradient error of the reversible backward pass against a float64 reference
  (ordinary backprop in float64), next to ordinary backprop in the same dtype,
  so the error the reversible pass adds is separated from the dtype's own,
* the same with anchors (``anchor_every`` in ``Config.anchors``), with the
  compiled activation memory of each backward pass relative to standard
  backprop's (float32), and the drift monitor's reading at every anchor next
  to the true reconstruction error there (each segment between anchors
  inverted on its own from the exact activation after it).

"Invertible in practice" is the largest depth whose relative reconstruction
error stays below ``Config.threshold``.

    python -m benchmarks.numerics [--quick | --tiny] [--out results]
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

from benchmarks import measure

NAME = "numerics"
COUPLINGS = ("additive", "affine_default", "affine_bounded", "affine_unbounded")
DTYPES = ("float32", "bfloat16", "float64")
DEPTHS = {"tiny": [2, 16], "quick": [4, 32, 128], "full": [2, 8, 32, 128, 512, 1024]}


@dataclasses.dataclass(frozen=True)
class Config:
    """The stacks' sizes and the measurement's settings.

    Attributes:
      width: Features, even (each coupling splits them into halves).
      batch: Rows of the input.
      scale_bound: Bound of ``affine_bounded``'s log-scale (``scale="tanh"``).
      init_scale: Variance scale of the residual nets' last layer.
      anchors: ``anchor_every`` values measured next to no anchors.
      threshold: Relative reconstruction error still counted as invertible.
    """

    width: int = 32
    batch: int = 16
    scale_bound: float = 2.0
    init_scale: float = 1.0
    anchors: tuple[int, ...] = (4, 16)
    threshold: float = 1e-2


def _block(coupling: str, args: Config):
    """The experiment's block: a coupling with random (non-identity) nets."""
    import haiku as hk
    import jax.numpy as jnp

    from revnet.blocks import AdditiveCoupling, AffineCoupling, ChannelPermutation

    half = args.width // 2
    init = hk.initializers.VarianceScaling(args.init_scale)

    def mlp(out):
        return lambda h: hk.Linear(out, w_init=init)(jnp.tanh(hk.Linear(half)(h)))

    scale = {
        "affine_default": {},
        "affine_bounded": {"scale": "tanh", "scale_bound": args.scale_bound},
        "affine_unbounded": {"scale": "exp"},
    }

    def block(h):
        if coupling == "additive":
            return AdditiveCoupling(mlp(half), mlp(half))(h)
        h = AffineCoupling(mlp(2 * half), zero_init=False, **scale[coupling])(h)
        return ChannelPermutation("reverse")(h)

    return block


def model(
    coupling: str,
    depth: int,
    args: Config,
    reversible: bool,
    anchor_every: int | None = None,
    drift: Any = None,
):
    """``(forward, inverse)`` transforms of a stack of ``depth`` blocks."""
    import haiku as hk

    from revnet.blocks import ReversibleSequence

    block = _block(coupling, args)

    def forward(x):
        return ReversibleSequence(
            block, depth, reversible, anchor_every=anchor_every, drift=drift
        )(x)

    def inverse(y):
        return ReversibleSequence(block, depth).inverse(y)

    return hk.transform(forward), hk.transform(inverse)


def rel_error(a: Any, b: Any) -> float:
    """Relative L2 error of pytree ``a`` against reference ``b`` (in float64)."""
    import jax
    import numpy as np

    num = sum(
        float(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )
    den = sum(float(np.sum(np.asarray(y, np.float64) ** 2)) for y in jax.tree.leaves(b))
    value = float(np.sqrt(num / max(den, 1e-300)))
    return value if np.isfinite(value) else float("inf")


@functools.cache
def _segment(coupling: str, n: int, args: Config) -> tuple[Any, Any]:
    """Jitted forward and inverse of ``n`` blocks, made once for every call."""
    import jax

    fwd, inv = model(coupling, n, args, reversible=True)
    return jax.jit(fwd.apply), jax.jit(inv.apply)


def true_drift(
    coupling: str, args: Config, params: Any, x: Any, every: int
) -> list[float]:
    """The reconstruction error at each anchor, measured without the monitor.

    The stack is cut into segments of ``every`` blocks (the parameters sliced
    along the layer axis). Running them one after another gives the exact
    activation at each anchor; inverting each segment on its own from the
    exact activation after it, as the anchored backward pass does, gives the
    rebuilt one. Returns the relative L2 error at each anchor, first first.
    """
    import jax

    depth = jax.tree.leaves(params)[0].shape[0]
    bounds = list(range(0, depth, every)) + [depth]
    cuts = list(zip(bounds, bounds[1:]))
    pieces = [jax.tree.map(lambda a, lo=lo, hi=hi: a[lo:hi], params) for lo, hi in cuts]
    segments = [_segment(coupling, hi - lo, args) for lo, hi in cuts]
    anchors = [x]
    for piece, (forward, _) in zip(pieces, segments):
        anchors.append(forward(piece, None, anchors[-1]))
    return [
        rel_error(inv(piece, None, after), exact)
        for piece, (_, inv), exact, after in zip(pieces, segments, anchors, anchors[1:])
    ]


def measure_rows(
    coupling: str, depth: int, args: Config, dtypes: Sequence[str]
) -> list[dict[str, Any]]:
    """Rows for one coupling and depth, one per dtype."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import revnet

    kx, kc = jax.random.split(jax.random.PRNGKey(1))
    x32 = jax.random.normal(kx, (args.batch, args.width), jnp.float32)
    cot32 = jax.random.normal(kc, (args.batch, args.width), jnp.float32)
    fwd_std, _ = model(coupling, depth, args, reversible=False)
    fwd_rev, inv = model(coupling, depth, args, reversible=True)
    monitors = {k: revnet.DriftMonitor() for k in args.anchors}
    anchored = {
        k: model(coupling, depth, args, True, anchor_every=k, drift=monitors[k])[0]
        for k in args.anchors
    }
    params32 = jax.jit(fwd_std.init)(jax.random.PRNGKey(0), x32)

    def cast(tree, dtype):
        return jax.tree.map(lambda a: a.astype(dtype), tree)

    def grad_fn(net):
        # A linear functional of the output, so the gradient is a plain VJP.
        def loss(params, x, c):
            return jnp.sum(net.apply(params, None, x).astype(jnp.float64) * c)

        return jax.grad(loss, argnums=(0, 1))

    p64, x64, c64 = (cast(t, jnp.float64) for t in (params32, x32, cot32))
    ref_grads = jax.jit(grad_fn(fwd_std))(p64, x64, c64)
    g_rev_fn, g_std_fn = grad_fn(fwd_rev), grad_fn(fwd_std)
    g_anchored = {k: grad_fn(net) for k, net in anchored.items()}

    # Activation memory of each backward pass relative to standard's (float32).
    temp = {
        name: measure.compile_stats(fn, params32, x32, cot32)[1]["temp_bytes"]
        for name, fn in [("standard", g_std_fn), ("reversible", g_rev_fn)]
        + [(k, fn) for k, fn in g_anchored.items()]
    }

    @jax.jit
    def everything(p, x, c):
        # One compiled program per dtype: forward, inverse and every gradient.
        y = fwd_rev.apply(p, None, x)
        anchored_grads = {k: fn(p, x, c) for k, fn in g_anchored.items()}
        return (
            y,
            inv.apply(p, None, y),
            g_rev_fn(p, x, c),
            g_std_fn(p, x, c),
            (anchored_grads),
        )

    rows = []
    for dtype_name in dtypes:
        dtype = jnp.dtype(dtype_name)
        p, x = cast(params32, dtype), x32.astype(dtype)
        for monitor in monitors.values():
            monitor.clear()
        y, x_rec, g_rev, g_std, g_anch = everything(p, x, c64)
        jax.effects_barrier()  # the monitors' readings have arrived
        out_norm = float(jnp.sqrt(jnp.mean(y.astype(jnp.float64) ** 2)))
        row = {
            "coupling": coupling,
            "depth": depth,
            "dtype": dtype_name,
            "reconstruction_rel_error": rel_error(x_rec, x64),
            "grad_rel_error_reversible": rel_error(g_rev, ref_grads),
            "grad_rel_error_standard": rel_error(g_std, ref_grads),
            "output_rms": out_norm if out_norm == out_norm else float("inf"),
            "temp_vs_standard": temp["reversible"] / temp["standard"]
            if dtype_name == "float32"
            else None,
            "anchored": {},
        }
        for k in args.anchors:
            readings = np.asarray(monitors[k].latest, np.float64)
            truth = np.asarray(true_drift(coupling, args, p, x, k), np.float64)
            row["anchored"][str(k)] = {
                "grad_rel_error": rel_error(g_anch[k], ref_grads),
                "temp_vs_standard": temp[k] / temp["standard"]
                if dtype_name == "float32"
                else None,
                "drift_readings": readings.tolist(),
                "true_drift": truth.tolist(),
                "drift_max": float(np.max(readings)),
                "true_drift_max": float(np.max(truth)),
            }
        rows.append(row)
        anchors_text = "  ".join(
            f"k={k}: grad {a['grad_rel_error']:.2e} drift {a['drift_max']:.2e} "
            f"(true {a['true_drift_max']:.2e})"
            for k, a in row["anchored"].items()
        )
        print(
            f"[numerics] {coupling:16s} depth {depth:5d} {dtype_name:8s} "
            f"recon {row['reconstruction_rel_error']:.2e}  grad rev "
            f"{row['grad_rel_error_reversible']:.2e} std "
            f"{row['grad_rel_error_standard']:.2e}  {anchors_text}",
            flush=True,
        )
    return rows


def invertible_limits(
    rows: list[dict[str, Any]], threshold: float
) -> dict[str, dict[str, Any]]:
    """Per coupling and dtype: the largest measured depth still invertible.

    A depth counts if its reconstruction error, and that of every smaller
    measured depth, is below ``threshold``. None means not even the smallest.
    """
    out: dict[str, dict[str, Any]] = {}
    for coupling in dict.fromkeys(r["coupling"] for r in rows):
        out[coupling] = {}
        for dtype in dict.fromkeys(r["dtype"] for r in rows):
            mine = sorted(
                (r for r in rows if r["coupling"] == coupling and r["dtype"] == dtype),
                key=lambda r: r["depth"],
            )
            best = None
            for r in mine:
                if not r["reconstruction_rel_error"] < threshold:
                    break
                best = r["depth"]
            out[coupling][dtype] = {
                "largest_invertible_depth": best,
                "all_measured_depths_ok": bool(mine) and best == mine[-1]["depth"],
            }
    return out


def _series(rows: list[dict[str, Any]], coupling: str, dtype: str) -> list[dict]:
    """The rows of one coupling and dtype, by depth."""
    mine = (r for r in rows if r["coupling"] == coupling and r["dtype"] == dtype)
    return sorted(mine, key=lambda r: r["depth"])


def plot(rows: list[dict[str, Any]], threshold: float, out: str) -> str:
    """Writes ``<out>/numerics.png``: errors and memory vs depth, four panels."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = (
        ("reconstruction_rel_error", "reconstruction |x' - x| / |x|"),
        ("grad_rel_error_reversible", "reversible gradient error vs float64"),
        (
            "grad_rel_error_standard",
            "standard backprop gradient error vs float64\n"
            "(float64 left out: it is the reference)",
        ),
    )
    colors = {"additive": "tab:green", "affine_default": "tab:purple"}
    colors.update(affine_bounded="tab:blue", affine_unbounded="tab:red")
    styles = {"float32": "-o", "bfloat16": "--s", "float64": ":^"}
    fig, axes = plt.subplots(1, 4, figsize=(22, 4.8))
    ceiling = 1e3  # non-finite errors are drawn at this level

    def finite(v):
        return max(v if math.isfinite(v) else ceiling, 1e-18)

    couplings = list(dict.fromkeys(r["coupling"] for r in rows))
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    series: list[list[dict[str, Any]]] = [[], [], [], []]
    for n, (key, _) in enumerate(keys):
        for coupling in couplings:
            for dtype in dtypes:
                if key == "grad_rel_error_standard" and dtype == "float64":
                    continue  # the float64 reference itself: 0 by construction
                mine = _series(rows, coupling, dtype)
                series[n].append(
                    {
                        "label": f"{coupling} {dtype}",
                        "x": [r["depth"] for r in mine],
                        "y": [finite(r[key]) for r in mine],
                        "color": colors[coupling],
                        "marker": styles[dtype][-1],
                        "ls": styles[dtype][:-1],
                    }
                )
    # Anchored float32 gradients next to the unanchored ones, and memory.
    for coupling in couplings:
        mine = _series(rows, coupling, "float32")
        if not mine:
            continue
        line = {"x": [r["depth"] for r in mine], "color": colors[coupling]}
        series[3].append(
            {
                **line,
                "label": f"{coupling} no anchors",
                "y": [r["temp_vs_standard"] for r in mine],
                "marker": "o",
            }
        )
        for n, k in enumerate(mine[0]["anchored"]):
            line.update(marker=("x", "+", "d", "v")[n % 4], ls="-.")
            series[1].append(
                {
                    **line,
                    "label": f"{coupling} float32 anchor_every={k}",
                    "y": [finite(r["anchored"][k]["grad_rel_error"]) for r in mine],
                }
            )
            series[3].append(
                {
                    **line,
                    "label": f"{coupling} anchor_every={k}",
                    "y": [r["anchored"][k]["temp_vs_standard"] for r in mine],
                }
            )
    for ax, (_, title), lines in zip(axes, keys, series):
        measure.plot_lines(ax, lines, log_y=True)
        ax.axhline(ceiling, color="black", lw=0.8, ls=":", label="non-finite")
        measure.log_axes(
            ax, "depth (blocks)", "relative error (non-finite at 1e3)", title
        )
    mem = axes[3]
    measure.plot_lines(mem, series[3], log_y=True)
    measure.log_axes(
        mem,
        "depth (blocks)",
        "temp bytes / standard backprop's",
        "activation memory of the backward pass (float32)",
    )
    axes[0].axhline(
        threshold, color="gray", ls="--", lw=1, label=f"invertible below {threshold:g}"
    )
    legends = [  # below the axes: inside, a legend covers points
        ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.16))
        for ax in axes
    ]
    for legend in legends:  # the axes keep their size, the saved PNG grows
        legend.set_in_layout(False)
    fig.tight_layout()
    for legend in legends:
        legend.set_in_layout(True)
    return measure.save_figure(fig, out, NAME)


def main(argv: Sequence[str] | None = None) -> dict:
    """Measures every coupling, depth and dtype; writes JSON and the plot."""
    import jax

    args = measure.parse(__doc__, argv)
    size = args.size
    couplings = COUPLINGS[:2] if args.tiny else COUPLINGS
    config = Config()
    jax.config.update("jax_enable_x64", True)
    rows = [
        row
        for coupling in couplings
        for depth in DEPTHS[size]
        for row in measure_rows(coupling, depth, config, DTYPES)
    ]
    plot(rows, config.threshold, args.out)
    limits = invertible_limits(rows, config.threshold)
    results = {"size": size, "config": dataclasses.asdict(config), "rows": rows}
    return measure.write_json(args.out, NAME, {**results, "limits": limits})


def markdown(results: dict, out: str) -> str:
    """The errors per coupling, depth and dtype, with anchors, and the limits."""
    rows = results["rows"]
    plain = [
        [r["coupling"], r["depth"], r["dtype"], r["reconstruction_rel_error"]]
        + [r["grad_rel_error_reversible"], r["grad_rel_error_standard"]]
        + [r.get("temp_vs_standard")]
        for r in rows
    ]
    anchored = [
        [r["coupling"], r["depth"], r["dtype"], int(k), a["grad_rel_error"]]
        + [r["grad_rel_error_standard"], a["temp_vs_standard"], a["drift_max"]]
        + [a["true_drift_max"]]
        for r in rows
        for k, a in r.get("anchored", {}).items()
    ]
    limits = [
        [c, d, v["largest_invertible_depth"]]
        for c, by in results["limits"].items()
        for d, v in by.items()
    ]
    head = ["coupling", "depth", "dtype", "reconstruction", "grad rev", "grad std"]
    head_a = ["coupling", "depth", "dtype", "k", "grad rev", "grad std"]
    return "\n\n".join(
        [
            "## Numerics: reconstruction and gradient error",
            "Relative L2 errors. Gradients are compared with ordinary backprop in "
            "float64 (so float64's `grad std` is 0 by construction). Invertible "
            f"means reconstruction error < {results['config']['threshold']:g} at "
            "that depth and every smaller measured depth.",
            f"![numerics]({NAME}.png)",
            measure.table(head + ["memory rev / std"], plain),
            "With anchors (`anchor_every=k`): gradient error, backward activation "
            "memory relative to standard backprop's (float32), and the drift "
            "monitor's largest reading next to the largest reconstruction error at "
            "an anchor measured independently.",
            measure.table(
                head_a + ["memory / std", "drift read", "drift true"], anchored
            ),
            measure.table(["coupling", "dtype", "largest invertible depth"], limits),
        ]
    )


if __name__ == "__main__":
    main()
