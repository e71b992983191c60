"""One coupling stack through each front door, against that framework's remat.

The same model (an additive coupling per layer whose ``f`` and ``g`` are
LayerNorm -> Linear -> tanh -> Linear on half the width) is written once per
framework, idiomatically: Haiku (``revnet.blocks``), Flax NNX (``revnet.nnx``)
and Equinox (``revnet.eqx``). Per front door and depth, three ways to train it:

* ``reversible``: the front door's ``ReversibleSequence``;
* ``remat``: the framework's own best same-FLOP baseline, a scan over stacked
  layers with each layer rematerialised: ``hk.layer_stack`` + ``hk.remat``,
  ``nnx.scan`` + ``nnx.remat``, ``lax.scan`` + ``eqx.filter_checkpoint``;
* ``standard``: the front door with ``reversible=False`` (a plain scan under
  ordinary autodiff, storing every layer's activations).

For each: compiled temp memory of one gradient step, its FLOPs (the scan body
is counted once by ``cost_analysis``, so FLOPs are per layer and comparable
between the three), and the median step time over interleaved rounds in this
process. A front door whose framework is not installed is reported as such.

    python -m benchmarks.front_doors [--quick | --tiny] [--out results]
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks import measure

NAME = "front_doors"
WIDTH, HIDDEN = 256, 512
DOORS = ("haiku", "nnx", "equinox")
METHODS = ("reversible", "remat", "standard")
SIZES = {
    "full": {"depths": [4, 16, 64], "batch": 256, "repeats": 15},
    "quick": {"depths": [4, 16, 32], "batch": 128, "repeats": 7},
    "tiny": {"depths": [2, 4], "batch": 16, "repeats": 3},
}
Step = tuple[Callable[..., Any], tuple[Any, ...]]


def _loss(y: jax.Array) -> jax.Array:
    return jnp.mean(jnp.sin(y))


# Haiku ---------------------------------------------------------------------


def _haiku(depth: int, x: jax.Array) -> dict[str, Step]:
    import haiku as hk

    from revnet import blocks

    def residual(h):
        h = hk.LayerNorm(-1, True, True)(h)
        h = jnp.tanh(hk.Linear(HIDDEN)(h))
        return hk.Linear(WIDTH // 2)(h)

    def coupling(h):
        return blocks.AdditiveCoupling(residual, residual)(h)

    def plain(h):  # the same arithmetic in plain Haiku
        h1, h2 = jnp.split(h, 2, axis=-1)
        y1 = h1 + residual(h2)
        return jnp.concatenate([y1, h2 + residual(y1)], axis=-1)

    nets = {
        m: hk.transform(
            lambda x, m=m: blocks.ReversibleSequence(
                coupling, depth, reversible=m == "reversible"
            )(x)
        )
        for m in ("reversible", "standard")
    }
    nets["remat"] = hk.transform(lambda x: hk.layer_stack(depth)(hk.remat(plain))(x))
    steps = {}
    for method, net in nets.items():
        params = net.init(jax.random.key(0), x)
        grad = jax.grad(lambda p, x, net=net: _loss(net.apply(p, None, x)))
        steps[method] = (grad, (params, x))
    return steps


# Flax NNX ------------------------------------------------------------------


def _nnx(depth: int, x: jax.Array) -> dict[str, Step]:
    from flax import nnx

    import revnet.nnx

    def residual(rngs):
        return nnx.Sequential(
            nnx.LayerNorm(WIDTH // 2, rngs=rngs),
            nnx.Linear(WIDTH // 2, HIDDEN, rngs=rngs),
            jnp.tanh,
            nnx.Linear(HIDDEN, WIDTH // 2, rngs=rngs),
        )

    class Coupling(nnx.Module):
        def __init__(self, *, rngs: nnx.Rngs):
            self.coupling = revnet.nnx.AdditiveCoupling(residual(rngs), residual(rngs))

        def __call__(self, h):
            return self.coupling(h)

    class Plain(nnx.Module):  # the same arithmetic in plain NNX
        def __init__(self, *, rngs: nnx.Rngs):
            self.f, self.g = residual(rngs), residual(rngs)

        def __call__(self, h):
            h1, h2 = jnp.split(h, 2, axis=-1)
            y1 = h1 + self.f(h2)
            return jnp.concatenate([y1, h2 + self.g(y1)], axis=-1)

    @nnx.split_rngs(splits=depth)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def plain_stack(rngs):
        return Plain(rngs=rngs)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat
    def remat_forward(h, block):
        return block(h)

    models = {
        m: revnet.nnx.ReversibleSequence(
            Coupling, depth, rngs=nnx.Rngs(0), reversible=m == "reversible"
        )
        for m in ("reversible", "standard")
    }
    models["remat"] = plain_stack(nnx.Rngs(0))
    steps = {}
    for method, model in models.items():
        graphdef, state = nnx.split(model)
        run = remat_forward if method == "remat" else (lambda h, m: m(h))

        def loss(state, x, graphdef=graphdef, run=run):
            return _loss(run(x, nnx.merge(graphdef, state)))

        steps[method] = (jax.grad(loss), (state, x))
    return steps


# Equinox -------------------------------------------------------------------


def _equinox(depth: int, x: jax.Array) -> dict[str, Step]:
    import equinox as eqx

    import revnet.eqx

    class Residual(eqx.Module):
        norm: eqx.nn.LayerNorm
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.norm = eqx.nn.LayerNorm(WIDTH // 2)
            self.up = eqx.nn.Linear(WIDTH // 2, HIDDEN, key=k1)
            self.down = eqx.nn.Linear(HIDDEN, WIDTH // 2, key=k2)

        def __call__(self, h, *, key=None):
            return self.down(jnp.tanh(self.up(self.norm(h))))

    class Plain(eqx.Module):  # the same arithmetic in plain Equinox
        f: Residual
        g: Residual

        def __call__(self, h):
            h1, h2 = jnp.split(h, 2, axis=-1)
            y1 = h1 + self.f(h2)
            return jnp.concatenate([y1, h2 + self.g(y1)], axis=-1)

    def make_coupling(key):
        kf, kg = jax.random.split(key)
        return revnet.eqx.AdditiveCoupling(Residual(kf), Residual(kg))

    def make_plain(key):
        kf, kg = jax.random.split(key)
        return Plain(Residual(kf), Residual(kg))

    key = jax.random.key(0)
    steps = {}
    for method in ("reversible", "standard"):
        seq = revnet.eqx.ReversibleSequence(
            make_coupling, depth, key=key, reversible=method == "reversible"
        )
        grad = eqx.filter_grad(lambda seq, x: _loss(seq(x)))
        steps[method] = (grad, (seq, x))

    stacked = eqx.filter_vmap(make_plain)(jax.random.split(key, depth))

    def remat_loss(stacked, x):
        params, static = eqx.partition(stacked, eqx.is_array)

        @eqx.filter_checkpoint
        def layer(h, p):
            return jax.vmap(eqx.combine(p, static))(h)

        return _loss(jax.lax.scan(lambda h, p: (layer(h, p), None), x, params)[0])

    steps["remat"] = (eqx.filter_grad(remat_loss), (stacked, x))
    return steps


BUILDERS: dict[str, tuple[str, Callable[[int, jax.Array], dict[str, Step]]]] = {
    "haiku": ("haiku", _haiku),
    "nnx": ("flax", _nnx),
    "equinox": ("equinox", _equinox),
}


def measure_door(door: str, depths: Sequence[int], batch: int, repeats: int) -> dict:
    """Memory, FLOPs and step time of the three methods at each depth."""
    package, build = BUILDERS[door]
    if importlib.util.find_spec(package) is None:
        return {"door": door, "missing": package}
    x = jax.random.normal(jax.random.key(1), (batch, WIDTH))
    rows = []
    for depth in depths:
        steps, stats, fns = build(depth, x), {}, {}
        for method, (grad, args) in steps.items():
            # Every leaf of the models (Haiku parameters, NNX state, Equinox
            # modules, whose other fields are static) is an array; the plain
            # function lets jax.jit take Equinox's filtered gradient too.
            def fn(*args, grad=grad):
                return grad(*args)

            compiled, stats[method] = measure.compile_stats(fn, *args)
            fns[method] = lambda compiled=compiled, args=args: compiled(*args)
        times = measure.median_times(fns, repeats)
        for method in METHODS:
            rows.append({"depth": depth, "method": method, **stats[method]})
            rows[-1].update(times[method])
    return {"door": door, "rows": rows}


def main(argv: Sequence[str] | None = None) -> dict:
    """Measures every front door; writes ``<out>/front_doors.json``."""
    args = measure.parse(__doc__, argv)
    size = SIZES[args.size]
    doors = [
        measure_door(door, size["depths"], size["batch"], size["repeats"])
        for door in DOORS
    ]
    results = {"width": WIDTH, "hidden": HIDDEN, "batch": size["batch"]}
    return measure.write_json(args.out, NAME, {**results, "doors": doors})


def markdown(results: dict, out: str) -> str:
    """Per front door and depth: temp MiB, FLOPs and step time of each method."""
    head = ["front door", "depth"]
    head += [f"temp MiB, {m}" for m in METHODS]
    head += ["FLOPs reversible / remat", "step ms: reversible / remat (ratio)"]
    rows = []
    for door in results["doors"]:
        if "missing" in door:
            rows.append([door["door"], f"not run: {door['missing']} not installed"])
            continue
        by = {(r["depth"], r["method"]): r for r in door["rows"]}
        for depth in sorted({d for d, _ in by}):
            rev, remat = by[depth, "reversible"], by[depth, "remat"]
            rows.append(
                [door["door"], depth]
                + [f"{by[depth, m]['temp_bytes'] / measure.MIB:.2f}" for m in METHODS]
                + [f"{rev['flops'] / remat['flops']:.3f}"]
                + [
                    f"{rev['median_s'] * 1e3:.1f} / {remat['median_s'] * 1e3:.1f} "
                    f"({rev['median_s'] / remat['median_s']:.2f})"
                ]
            )
    intro = (
        "## Front doors: Haiku, Flax NNX, Equinox\n\n"
        f"An additive coupling stack (width {results['width']}, hidden "
        f"{results['hidden']}, batch {results['batch']}), one gradient step. "
        "`remat` is each framework's own scan over layers with every layer "
        "rematerialised; `standard` stores every activation. FLOPs of a scan "
        "count its body once, so they are per layer.\n\n"
    )
    return intro + measure.table(head, rows)


if __name__ == "__main__":
    main()
