"""Flows: one coupling flow's log-determinant three ways, memory, FLOPs, time.

The flow is flowjax's own: each layer a ``flowjax.bijections.Coupling`` (an
affine transformer, an MLP conditioner) then a ``Flip``, the layers' parameters
stacked and run in a scan. The same layers and parameters run three ways,
each trained on the negative log-likelihood under a standard normal:

* ``flowjax``: flowjax's ``Scan`` with its hand-written log-determinants,
  under plain backprop;
* ``jet-style``: the same hand-written log-determinants with each layer under
  ``jax.checkpoint`` (nothing saveable) in a ``lax.scan``, as big_vision's
  Jet wraps each coupling in ``nn.remat`` inside ``nn.scan``;
* ``revnet``: ``revnet.forward_and_log_det`` of a ``revnet.invertible`` scan
  over the layers' ``transform`` alone: the log-determinant is derived from
  flowjax's forward program, and the backward pass rebuilds activations.

For each: the largest log-determinant difference from flowjax's, the compiled
temp memory of the gradient step at each depth, its FLOPs (the scan body is
counted once by ``cost_analysis``, so this is per layer plus the rest), and
the median step time relative to flowjax's, from interleaved rounds.

    python -m benchmarks.flows [--quick | --tiny] [--out results]
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib.metadata import version

import equinox as eqx
import jax
import jax.numpy as jnp

import revnet
from benchmarks import measure

NAME = "flows"
DIM, WIDTH = 16, 64
WAYS = ("flowjax", "jet-style", "revnet")


def layers(depth: int, dim: int, width: int, seed: int = 0):
    """flowjax's layers, stacked: ``(params, static)`` of one ``Chain``."""
    from flowjax.bijections import Affine, Chain, Coupling, Flip

    def make(key):
        coupling = Coupling(
            key,
            transformer=Affine(),
            untransformed_dim=dim // 2,
            dim=dim,
            nn_width=width,
            nn_depth=1,
        )
        # The conditioner's output layer scaled down, so that each layer is
        # near the identity, as a trained flow's initialisation makes it: a
        # random one multiplies the scales of 128 layers past float32's range.
        return eqx.tree_at(
            lambda c: c.bijections[0].conditioner.layers[-1].weight,
            Chain([coupling, Flip((dim,))]),
            replace_fn=lambda w: 0.1 * w,
        )

    stacked = eqx.filter_vmap(make)(jax.random.split(jax.random.key(seed), depth))
    return eqx.partition(stacked, eqx.is_inexact_array)


def forward(way: str, static):
    """``forward(params, x) -> (z, log_det)`` on a batch ``x`` of ``[n, dim]``."""
    from flowjax.bijections import Scan

    def one_layer(p):
        return eqx.combine(p, static)

    if way == "flowjax":

        def run(params, x):
            flow = Scan(eqx.combine(params, static))
            return jax.vmap(flow.transform_and_log_det)(x)

    elif way == "jet-style":

        def run(params, x):
            def body(carry, p):
                h, total = carry
                step = jax.checkpoint(
                    lambda p, h: jax.vmap(one_layer(p).transform_and_log_det)(h),
                    policy=jax.checkpoint_policies.nothing_saveable,
                )
                h, ld = step(p, h)
                return (h, total + ld), None

            zero = jnp.zeros(x.shape[:1], x.dtype)
            return jax.lax.scan(body, (x, zero), params)[0]

    else:

        def run(params, x):
            @revnet.invertible
            def stack(h):
                def body(h, p):
                    return one_layer(p).transform(h), None

                return jax.lax.scan(body, h, params)[0]

            return jax.vmap(lambda xb: revnet.forward_and_log_det(stack, xb))(x)

    return run


def nll(run):
    def loss(params, x):
        z, log_det = run(params, x)
        log_prob = -0.5 * jnp.sum(z * z, -1) - 0.5 * z.shape[-1] * jnp.log(2 * jnp.pi)
        return -jnp.mean(log_prob + log_det)

    return loss


def measure_depth(depth: int, batch: int, repeats: int) -> dict:
    params, static = layers(depth, DIM, WIDTH)
    x = jax.random.normal(jax.random.key(1), (batch, DIM))
    runs = {w: forward(w, static) for w in WAYS}
    ref = jax.jit(runs["flowjax"])(params, x)[1]
    row: dict = {"depth": depth, "log_det_max_abs": float(jnp.max(jnp.abs(ref)))}
    steps = {}
    for w in WAYS:
        log_det = jax.jit(runs[w])(params, x)[1]
        row[f"log_det_diff_{w}"] = float(jnp.max(jnp.abs(log_det - ref)))
        compiled, stats = measure.compile_stats(jax.grad(nll(runs[w])), params, x)
        row[f"temp_{w}"] = int(stats["temp_bytes"])
        row[f"flops_{w}"] = stats["flops"]
        steps[w] = lambda c=compiled: c(params, x)
    if repeats:
        times = measure.median_times(steps, repeats)
        base = times["flowjax"]["median_s"]
        for w in WAYS:
            row[f"time_ratio_{w}"] = times[w]["median_s"] / base
    return row


def main(argv: Sequence[str] | None = None) -> dict:
    """Measures each depth; writes ``<out>/flows.json``."""
    args = measure.parse(__doc__, argv)
    depths = (2, 8) if args.tiny else (8, 32, 128)
    batch = 16 if args.tiny else 128
    repeats = 3 if args.tiny else (10 if args.quick else 30)
    rows = [measure_depth(d, batch, repeats if d == depths[-1] else 0) for d in depths]
    results = {"flowjax": version("flowjax"), "dim": DIM, "width": WIDTH}
    results.update(batch=batch, rows=rows)
    return measure.write_json(args.out, NAME, results)


def markdown(results: dict, out: str) -> str:
    """The log-det differences, memory, FLOPs and time, per way and depth."""
    rows = []
    for r in results["rows"]:
        for w in WAYS:
            ratio = r.get(f"time_ratio_{w}")
            rows.append(
                [w, r["depth"], r[f"log_det_diff_{w}"], f"{r[f'temp_{w}']:,}"]
                + [f"{r[f'flops_{w}']:,.0f}", "" if ratio is None else f"{ratio:.2f}"]
            )
    head = ["way", "depth", "max |log-det - flowjax's|", "temp bytes"]
    head += ["FLOPs (scan body once)", "median step time / flowjax's"]
    intro = (
        f"flowjax {results['flowjax']}, dimension {results['dim']}, conditioner "
        f"width {results['width']}, batch {results['batch']}; float32, CPU.\n\n"
    )
    return (
        "## Flows: derived vs hand-written log-determinants\n\n"
        + intro
        + (measure.table(head, rows))
    )


if __name__ == "__main__":
    main()
