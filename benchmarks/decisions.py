"""Decisions in F: gradients and stored bytes, stored vs recomputed.

Six coupling stacks whose F makes a decision (``b > 0``, ``sign``, ``round``,
argmax routing, top-k gating, one-hot expert dispatch) run at depth 32 in
float32 on inputs with exact ties (halves, and weights in eighths, so that
``b @ w`` has exact zeros and equal logits). For each, the gradient of
``revnet.invertible`` with decisions stored (the default) and recomputed is
compared with ``jax.grad`` of the same function, leaf by leaf, relative to the
leaf's largest entry, and the compiled ``jit(grad)`` temp memory of the
stored run is compared with the recomputed one: the difference is the bytes of
the stored decisions.

    python -m benchmarks.decisions [--quick | --tiny] [--out results]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import revnet
from benchmarks import measure

NAME = "decisions"
WIDTH, BATCH, EXPERTS = 8, 256, 4


def _route(h, wr):
    return jnp.argmax(h @ wr, -1)


def _gt(h, p):
    return jnp.where(h > 0, 0.5, -0.25) + 0.5 * jnp.tanh(h)


def _sign(h, p):
    return 0.25 * jnp.sign(h) + 0.5 * jnp.tanh(h)


def _round(h, p):
    return 0.25 * jnp.round(2 * h) + 0.5 * jnp.tanh(h)


def _argmax(h, p):
    return jax.nn.one_hot(_route(h, p["router"]), WIDTH, dtype=h.dtype) * jnp.tanh(h)


def _top_k(h, p):
    vals, idx = jax.lax.top_k(h @ p["router"], 2)
    gates = jax.nn.softmax(vals, -1)
    mask = jnp.sum(jax.nn.one_hot(idx, WIDTH, dtype=h.dtype) * gates[..., None], -2)
    return mask * jnp.tanh(h)


def _dispatch(h, p):
    onehot = jax.nn.one_hot(_route(h, p["router"]), EXPERTS, dtype=h.dtype)
    out = jnp.einsum("ne,nd,edf->nf", onehot, h, p["experts"])
    return jnp.tanh(out)


PROGRAMS: dict[str, Callable] = {
    "b > 0": _gt,
    "sign": _sign,
    "round": _round,
    "argmax routing": _argmax,
    "top-k gating": _top_k,
    "one-hot dispatch": _dispatch,
}


def params(depth: int, dtype=jnp.float32, seed: int = 0) -> dict:
    """Per-layer weights, stacked: eighths in ``[-1/2, 1/2]`` (exact products)."""
    rng = np.random.default_rng(seed)

    def q(*shape):
        return jnp.asarray(rng.integers(-4, 5, (depth, *shape)) / 8, dtype)

    return {
        "f": q(WIDTH, WIDTH),
        "g": q(WIDTH, WIDTH),
        "router": q(WIDTH, WIDTH),
        "experts": q(EXPERTS, WIDTH, WIDTH),
    }


def inputs(dtype=jnp.float32, seed: int = 1):
    """Two streams of halves in ``[-1, 1]``: zeros and ties everywhere."""
    rng = np.random.default_rng(seed)
    a, b = (rng.integers(-2, 3, (2, BATCH, WIDTH)) / 2).astype(np.float64)
    return jnp.asarray(a, dtype), jnp.asarray(b, dtype)


def stack(decide: Callable, ps: dict):
    """``f(a, b)``: an additive coupling per layer, scanned over ``ps``."""

    def layer(c, p):
        a, b = c
        a = a + decide(b @ p["f"], p)
        b = b + decide(a @ p["g"], p)
        return (a, b), None

    def f(a, b):
        return jax.lax.scan(layer, (a, b), ps)[0]

    return f


def loss_fn(decide: Callable, wrap=None):
    """``loss(params, a, b)``; ``wrap`` (e.g. ``revnet.invertible``) the stack."""

    def loss(ps, a, b):
        f = stack(decide, ps)
        outs = (wrap(f) if wrap else f)(a, b)
        return sum(jnp.sum(jnp.sin(o)) for o in outs)

    return loss


def leaf_errors(got, want) -> list[float]:
    """Per leaf: max |got - want| / max |want| (absolute where ``want`` is 0)."""
    out = []
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        scale = float(jnp.max(jnp.abs(w)))
        out.append(float(jnp.max(jnp.abs(g - w))) / (scale if scale > 0 else 1.0))
    return out


def temp_bytes(fun, *args) -> int:
    """Compiled ``temp_size_in_bytes`` of the jitted ``fun`` at ``args``."""
    return fun.lower(*args).compile().memory_analysis().temp_size_in_bytes


def measure_program(name: str, depth: int) -> dict:
    """Gradient errors and temp bytes of one program, stored and recomputed."""
    decide = PROGRAMS[name]
    ps, (a, b) = params(depth), inputs()
    want = jax.grad(loss_fn(decide), (0, 1, 2))(ps, a, b)
    row = {"program": name, "depth": depth}
    for mode in ("store", "recompute"):
        wrap = lambda f, mode=mode: revnet.invertible(f, decisions=mode)  # noqa: E731
        step = jax.jit(jax.grad(loss_fn(decide, wrap), (0, 1, 2)))
        row[f"error_{mode}"] = max(leaf_errors(step(ps, a, b), want))
        row[f"temp_{mode}"] = temp_bytes(step, ps, a, b)
    row["stored_bytes"] = row["temp_store"] - row["temp_recompute"]
    return row


def main(argv: Sequence[str] | None = None) -> dict:
    """Measures every program; writes ``<out>/decisions.json``."""
    args = measure.parse(__doc__, argv)
    depth = 8 if args.tiny else 32
    rows = [measure_program(name, depth) for name in PROGRAMS]
    return measure.write_json(args.out, NAME, {"rows": rows})


def markdown(results: dict, out: str) -> str:
    """Gradient errors and temp bytes, stored vs recomputed, per program."""
    rows = [
        [r["program"], r["depth"], r["error_store"], r["error_recompute"]]
        + [f"{r['temp_store']:,}", f"{r['temp_recompute']:,}"]
        for r in results["rows"]
    ]
    head = ["F's decision", "depth", "gradient error, stored"]
    head += ["gradient error, recomputed", "temp bytes, stored"]
    return "## Decisions in F: stored vs recomputed\n\n" + measure.table(
        head + ["temp bytes, recomputed"], rows
    )


if __name__ == "__main__":
    main()
