"""The reversible transformer on a 4 x 2 ("data", "model") mesh: per-device
memory against depth, and collectives per step.

Parameters are placed by ``blocks.partition`` with ``blocks.TRANSFORMER_RULES``
(FSDP over ``data``, attention heads and the MLP's hidden width over
``model``) and the stream is constrained to ``P("data")``. For each depth
(4, 8, 16, 32) it reports the compiled ``temp_size_in_bytes`` of one
``jit(grad(loss))`` step, which for a sharded program is per device, for

* ``reversible``: ``ReversibleTransformer`` (Auto mesh axes, and Explicit);
* ``standard``: the same parameters with ``reversible=False``;
* ``remat``: ``hk.layer_stack`` over ``hk.remat`` of the same layer, with the
  same constraints (the best plain baseline; Auto mesh axes),

and, at one depth, the collectives in the compiled HLO (``all-reduce``,
``all-gather``, ``reduce-scatter``, ``collective-permute``, ``all-to-all``;
a loop body's collectives counted once, as they are written).

It needs 8 devices: ``main`` runs the measurement in a subprocess with 8
forced CPU devices (``--xla_force_host_platform_device_count=8``).

    python -m benchmarks.sharding [--quick | --tiny] [--out results]
        [--depths 4 8 16 32] [--collectives-depth 8]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks import measure

NAME = "sharding"
DEVICES = 8
AXES = {"embed": "data", "heads": "model", "mlp": "model"}
SHAPE = {"batch": 16, "time": 32, "model_size": 64, "mlp_size": 256, "heads": 4}
COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "collective-permute",
    "all-to-all",
)
_OP = re.compile(r"\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def count_collectives(hlo: str) -> dict[str, int]:
    """Collective operations written in an HLO module's text, by kind."""
    counts = dict.fromkeys(COLLECTIVES, 0)
    for match in _OP.finditer(hlo):
        counts[match.group(1)] += 1
    return counts


def meshes() -> dict[str, Any]:
    """The 4 x 2 mesh with Auto axes and with Explicit axes."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    return {
        "auto": Mesh(
            np.array(jax.devices()[:DEVICES]).reshape(4, 2), ("data", "model")
        ),
        "explicit": jax.make_mesh((4, 2), ("data", "model")),
    }


def model(depth: int, method: str):
    """``hk.transform`` of the encoder run as ``method``, and its loss."""
    import haiku as hk
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from benchmarks.models import plain_interceptor
    from revnet import blocks

    def forward(x):
        enc = blocks.ReversibleTransformer(
            depth,
            SHAPE["heads"],
            SHAPE["model_size"],
            SHAPE["mlp_size"],
            reversible=method == "reversible",
            activation_sharding=P("data"),
        )
        if method == "remat":
            remat = plain_interceptor("layer_stack", remat=True, spec=P("data"))
            with hk.intercept_methods(remat):
                return enc(x, False)
        return enc(x, False)

    net = hk.transform(forward)

    def loss(params, x):
        return jnp.mean(jnp.sin(net.apply(params, None, x)) ** 2)

    return net, loss


def step(depth: int, method: str, mesh: Any):
    """``(jit(grad(loss)), params, x)``: sharded inputs, abstract sharded params."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from benchmarks.models import convert
    from revnet import blocks

    net, loss = model(depth, "reversible" if method == "remat" else method)
    shape = (SHAPE["batch"], SHAPE["time"], SHAPE["model_size"])
    x = jax.random.normal(jax.random.key(1), shape)
    with jax.set_mesh(mesh):
        # Shapes and placements only: what the step compiles for (the values
        # do not enter its memory or collectives; an init would compile too).
        params = jax.eval_shape(net.init, jax.random.key(0), x)
        if method == "remat":
            params = convert(params, "layer_stack")
            net, loss = model(depth, "remat")
        params = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            params,
            blocks.partition(params, mesh, blocks.TRANSFORMER_RULES, axes=AXES),
        )
        x = jax.device_put(x, NamedSharding(mesh, P("data")))
    return jax.jit(jax.grad(loss)), params, x


def measure_rows(depths: list[int], collectives_depth: int) -> list[dict]:
    """The rows: one per (method, mode, depth)."""
    import jax

    import revnet

    revnet.set_runtime_checks(False)
    assert jax.device_count() >= DEVICES, jax.device_count()
    rows = []
    plan = [("reversible", "auto"), ("reversible", "explicit"), ("standard", "auto")]
    plan.append(("remat", "auto"))
    for method, mode in plan:
        mesh = meshes()[mode]
        for depth in depths:
            fn, params, x = step(depth, method, mesh)
            with jax.set_mesh(mesh):
                compiled = fn.lower(params, x).compile()
            row = {
                "method": method,
                "mode": mode,
                "depth": depth,
                "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
            }
            if depth == collectives_depth:
                row["collectives"] = count_collectives(compiled.as_text())
            rows.append(row)
    return rows


def _flags(parser: argparse.ArgumentParser) -> None:
    count = measure.flags.positive_int
    parser.add_argument("--depths", type=count, nargs="+", default=None)
    parser.add_argument("--collectives-depth", type=count, default=8)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def main(argv: Sequence[str] | None = None) -> dict:
    """Measures in a subprocess with 8 CPU devices; writes ``sharding.json``."""
    args = measure.parse(__doc__, argv, _flags)
    depths = args.depths or ([4, 8] if args.tiny else [4, 8, 16, 32])
    if args.worker:
        print(json.dumps(measure_rows(depths, args.collectives_depth)))
        return {}
    flags = f"{os.environ.get('XLA_FLAGS', '')} "
    flags += f"--xla_force_host_platform_device_count={DEVICES}"
    # XLA:CPU's pool of max(cores, devices) threads can deadlock a collective
    # when the next program's launches hold threads; twice the devices cannot.
    env = dict(os.environ, XLA_FLAGS=flags, PJRT_NPROC=str(2 * DEVICES))
    command = [sys.executable, "-m", "benchmarks.sharding", "--worker", "--depths"]
    command += [str(d) for d in depths]
    command += ["--collectives-depth", str(args.collectives_depth)]
    command += ["--out", args.out]
    proc = subprocess.run(
        command, cwd=measure.ROOT, env=env, capture_output=True, text=True
    )
    if proc.returncode:
        raise RuntimeError(f"benchmarks.sharding worker failed:\n{proc.stderr[-4000:]}")
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    return measure.write_json(args.out, NAME, {"rows": rows})


def markdown(results: dict, out: str) -> str:
    """A memory table (MiB per device against depth) and a collectives table."""
    results = results["rows"]
    depths = sorted({r["depth"] for r in results})
    keys = list(dict.fromkeys((r["method"], r["mode"]) for r in results))
    mib = {
        (r["method"], r["mode"], r["depth"]): r["temp_bytes"] / 2**20 for r in results
    }
    lines = [
        "## Sharding: the transformer on a 4 x 2 mesh",
        "",
        "| per-device temp MiB | " + " | ".join(f"depth {d}" for d in depths) + " |",
        "|---" * (len(depths) + 1) + "|",
    ]
    for method, mode in keys:
        cells = [f"{mib[method, mode, d]:.2f}" for d in depths]
        lines.append(f"| {method} ({mode}) | " + " | ".join(cells) + " |")
    counted = [r for r in results if "collectives" in r]
    if counted:
        lines += [
            "",
            f"| collectives in the HLO, depth {counted[0]['depth']} | "
            + " | ".join(COLLECTIVES)
            + " | total |",
            "|---" * (len(COLLECTIVES) + 2) + "|",
        ]
        for r in counted:
            c = r["collectives"]
            cells = [str(c[k]) for k in COLLECTIVES] + [str(sum(c.values()))]
            lines.append(f"| {r['method']} ({r['mode']}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
