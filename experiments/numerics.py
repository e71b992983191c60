"""Reconstruction and gradient error of reversible stacks vs depth and dtype.

For additive couplings, affine couplings with the default soft bound on the
log-scale and affine couplings with an unbounded log-scale, each stack
(``ReversibleSequence``; affine blocks are followed by a channel reversal so
both halves get transformed) runs in float32, bfloat16 and float64 from the
same parameters. Measured per depth:

* reconstruction error ``|inverse(f(x)) - x| / |x|`` (relative L2 norms),
* gradient error of the reversible backward pass against a float64 reference
  (ordinary backprop in float64), next to ordinary backprop in the same dtype,
  so the error the reversible pass adds is separated from the dtype's own.

"Invertible in practice" is read off as the largest depth whose relative
reconstruction error stays below ``--threshold``.

Run ``python -m experiments.numerics --help`` for the flags.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from experiments import common

DESCRIPTION = __doc__.split("\n\n")[0]
COUPLINGS = ("additive", "affine_bounded", "affine_unbounded")
DTYPES = ("float32", "bfloat16", "float64")


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = common.make_parser("python -m experiments.numerics", DESCRIPTION)
    parser.add_argument(
        "--depths",
        type=common.int_list,
        default=None,
        help="comma-separated depths (default: 4,32,128 quick; up to 1024 full)",
    )
    parser.add_argument(
        "--couplings",
        type=common.choice_list(COUPLINGS),
        default=list(COUPLINGS),
        help=f"comma-separated couplings (default: {','.join(COUPLINGS)})",
    )
    parser.add_argument(
        "--dtypes",
        type=common.choice_list(DTYPES),
        default=list(DTYPES),
        help=f"comma-separated dtypes (default: {','.join(DTYPES)})",
    )
    parser.add_argument(
        "--width",
        type=common.even_int,
        default=32,
        help="features, even: each coupling splits them into halves (default: 32)",
    )
    parser.add_argument("--batch", type=common.positive_int, default=16)
    parser.add_argument(
        "--scale-bound",
        type=common.positive_float,
        default=2.0,
        help="soft bound of the affine log-scale (default: 2.0)",
    )
    parser.add_argument(
        "--init-scale",
        type=common.positive_float,
        default=1.0,
        help="variance scale of the residual nets' last layer (larger = harder)",
    )
    parser.add_argument(
        "--threshold",
        type=common.positive_float,
        default=1e-2,
        help="relative reconstruction error still counted as invertible",
    )
    return parser


def _model(coupling: str, depth: int, args: argparse.Namespace, reversible: bool):
    import haiku as hk
    import jax.numpy as jnp

    from revnet.blocks import (
        AdditiveCoupling,
        AffineCoupling,
        ChannelPermutation,
        ReversibleSequence,
    )

    half = args.width // 2
    init = hk.initializers.VarianceScaling(args.init_scale)

    def mlp(out):
        return lambda h: hk.Linear(out, w_init=init)(jnp.tanh(hk.Linear(half)(h)))

    def block(h):
        if coupling == "additive":
            return AdditiveCoupling(mlp(half), mlp(half))(h)
        bound = args.scale_bound if coupling == "affine_bounded" else None
        h = AffineCoupling(mlp(2 * half), scale_bound=bound)(h)
        return ChannelPermutation("reverse")(h)

    def forward(x):
        return ReversibleSequence(block, depth, reversible=reversible)(x)

    def inverse(y):
        return ReversibleSequence(block, depth, reversible=reversible).inverse(y)

    return hk.transform(forward), hk.transform(inverse)


def _rel(a: Any, b: Any) -> float:
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


def measure(
    coupling: str, depth: int, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """All dtypes for one coupling and depth; one row per dtype."""
    import jax
    import jax.numpy as jnp

    kx, kc = jax.random.split(jax.random.PRNGKey(1))
    x32 = jax.random.normal(kx, (args.batch, args.width), jnp.float32)
    cot32 = jax.random.normal(kc, (args.batch, args.width), jnp.float32)
    fwd_std, _ = _model(coupling, depth, args, reversible=False)
    fwd_rev, inv = _model(coupling, depth, args, reversible=True)
    params32 = jax.jit(fwd_std.init)(jax.random.PRNGKey(0), x32)

    def cast(tree, dtype):
        return jax.tree.map(lambda a: a.astype(dtype), tree)

    def grad_fn(net):
        # A linear functional of the output, so the gradient is a plain VJP.
        def loss(params, x, c):
            return jnp.sum(net.apply(params, None, x).astype(jnp.float64) * c)

        return jax.jit(jax.grad(loss, argnums=(0, 1)))

    p64, x64, c64 = (cast(t, jnp.float64) for t in (params32, x32, cot32))
    ref_grads = grad_fn(fwd_std)(p64, x64, c64)
    g_rev_fn, g_std_fn = grad_fn(fwd_rev), grad_fn(fwd_std)

    @jax.jit
    def everything(p, x, c):
        # One compiled program per dtype: forward, inverse and both gradients.
        y = fwd_rev.apply(p, None, x)
        return y, inv.apply(p, None, y), g_rev_fn(p, x, c), g_std_fn(p, x, c)

    rows = []
    for dtype_name in args.dtypes:
        dtype = jnp.dtype(dtype_name)
        p, x = cast(params32, dtype), x32.astype(dtype)
        y, x_rec, g_rev, g_std = everything(p, x, c64)
        out_norm = float(jnp.sqrt(jnp.mean(y.astype(jnp.float64) ** 2)))
        rows.append(
            {
                "coupling": coupling,
                "depth": depth,
                "dtype": dtype_name,
                "reconstruction_rel_error": _rel(x_rec, x64),
                "grad_rel_error_reversible": _rel(g_rev, ref_grads),
                "grad_rel_error_standard": _rel(g_std, ref_grads),
                "output_rms": out_norm if out_norm == out_norm else float("inf"),
            }
        )
        r = rows[-1]
        print(
            f"[numerics] {coupling:16s} depth {depth:5d} {dtype_name:8s} "
            f"recon {r['reconstruction_rel_error']:.2e}  grad rev "
            f"{r['grad_rel_error_reversible']:.2e} std "
            f"{r['grad_rel_error_standard']:.2e}",
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


def plot(rows: list[dict[str, Any]], threshold: float, out: str) -> str:
    """Writes ``<out>/numerics.png``: errors vs depth, one panel per quantity."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = (
        ("reconstruction_rel_error", "reconstruction |x' - x| / |x|"),
        ("grad_rel_error_reversible", "reversible gradient error vs float64"),
        ("grad_rel_error_standard", "standard backprop gradient error vs float64"),
    )
    colors = {"additive": "tab:green", "affine_bounded": "tab:blue"}
    colors["affine_unbounded"] = "tab:red"
    styles = {"float32": "-o", "bfloat16": "--s", "float64": ":^"}
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    ceiling = 1e3  # non-finite errors are drawn at this level
    for ax, (key, title) in zip(axes, keys, strict=True):
        for coupling in dict.fromkeys(r["coupling"] for r in rows):
            for dtype in dict.fromkeys(r["dtype"] for r in rows):
                mine = sorted(
                    (
                        r
                        for r in rows
                        if r["coupling"] == coupling and r["dtype"] == dtype
                    ),
                    key=lambda r: r["depth"],
                )
                vals = [r[key] if math.isfinite(r[key]) else ceiling for r in mine]
                ax.plot(
                    [r["depth"] for r in mine],
                    [max(v, 1e-18) for v in vals],
                    styles[dtype],
                    color=colors[coupling],
                    label=f"{coupling} {dtype}",
                )
        ax.axhline(ceiling, color="black", lw=0.8, ls=":")
        ax.set(xscale="log", yscale="log", xlabel="depth (blocks)", title=title)
        ax.set_ylabel("relative error (non-finite drawn at 1e3)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].axhline(threshold, color="gray", ls="--", lw=1)
    axes[0].legend(fontsize=7, ncol=1)
    fig.tight_layout()
    return common.save_figure(fig, out, "numerics")


def main(argv: list[str] | None = None) -> int:
    """Entry point: parses flags, measures, writes JSON and plot."""
    parser = build_parser()
    args = common.parse_args(parser, argv)
    if args.depths is None:
        args.depths = (
            [2, 16]
            if args.tiny
            else [4, 32, 128]
            if args.quick
            else [2, 8, 32, 128, 512, 1024]
        )
    if args.tiny and args.couplings == list(COUPLINGS):
        args.couplings = ["additive", "affine_bounded"]
    import jax

    jax.config.update("jax_enable_x64", True)
    rows = [
        row
        for coupling in args.couplings
        for depth in args.depths
        for row in measure(coupling, depth, args)
    ]
    results = {"rows": rows, "limits": invertible_limits(rows, args.threshold)}
    common.write_json(args.out, "numerics", vars(args), results)
    plot(rows, args.threshold, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
