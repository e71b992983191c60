"""fdtdx's FDTD step in revnet: inverse design in flat memory, PML refused aloud.

A 16 x 16 cell plane with a point dipole, a 4 x 4 dielectric design region
and a detector box; the loss is the field energy in the box after ``--steps``
steps of fdtdx's own update, ``fdtd.forward.forward``, bound as fdtdx's
``checkpointed_fdtd`` binds it, unchanged.

1. **Periodic boundaries**: ``revnet.scan(..., mode="invert")`` runs the update
   backwards, holding one field state whatever the number of steps. Its
   gradient is compared with ``jax.checkpoint`` over ``lax.scan`` of the same
   update (fdtdx's ``checkpointed_fdtd``'s program) and the compiled temp
   memory of both is printed at two step counts; a few gradient steps then
   raise the energy in the box.
2. **PML boundaries**: the absorbing layer multiplies the fields by a factor
   below 1 every step, so running it backwards divides by it and the rebuilt
   fields blow up. revnet's boundary check says so in one line (a
   ``revnet.DriftWarning``; ``"raise"`` makes it an error), and
   ``mode="checkpoint"`` gives the gradient.

    python examples/fdtd_design.py                  # 2,000 steps
    python examples/fdtd_design.py --smoke          # 400 steps, seconds
    python examples/fdtd_design.py --out runs/fdtd  # writes fdtd_design.json

It needs fdtdx: ``pip install -e '.[simulation]'``.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # _flags, _durable, revnet from a checkout

import _flags  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; a bad one ends the program with one line (exit status 2)."""
    parser = _flags.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--smoke", action="store_true", help="400 steps, two updates")
    add("--steps", type=_flags.positive_int, default=None, help="default 2,000")
    add("--updates", type=_flags.positive_int, default=None, help="default 4")
    add("--out", type=_flags.writable_dir, help="writes DIR/fdtd_design.json")
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # bad flags end here, before the slow imports below
    try:
        import fdtdx  # noqa: F401
    except ImportError:
        _flags.fail("fdtdx is not installed: pip install -e '.[simulation]'")

import _durable  # noqa: E402
import fdtdx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from fdtdx.fdtd.forward import forward  # noqa: E402

import revnet  # noqa: E402

N, PML, SPACING, LR = 16, 4, 100e-9, 0.5
DESIGN, BOX, SOURCE_X = (slice(6, 10), slice(6, 10)), (slice(11, 13), slice(6, 10)), 4


def build(steps: int, pml: bool):
    """fdtdx's objects, arrays and config for ``steps`` steps."""
    grid = fdtdx.UniformGrid(spacing=SPACING)
    probe = fdtdx.SimulationConfig(time=1e-15, grid=grid, backend="cpu")
    config = fdtdx.SimulationConfig(
        time=steps * probe.time_step_duration, grid=grid, backend="cpu"
    )
    volume = fdtdx.SimulationVolume(partial_grid_shape=(N, N, 1))
    bounds = fdtdx.BoundaryConfig.from_uniform_bound(
        thickness=PML,
        boundary_type="pml" if pml else "periodic",
        override_types={"min_z": "periodic", "max_z": "periodic"},
    )
    boundaries, constraints = fdtdx.boundary_objects_from_config(bounds, volume)
    source = fdtdx.PointDipoleSource(
        partial_grid_shape=(1, 1, 1),
        polarization=2,
        wave_character=fdtdx.WaveCharacter(wavelength=1.55e-6),
    )
    constraints.append(
        source.set_grid_coordinates(
            axes=(0, 1, 2), sides=("-", "-", "-"), coordinates=(SOURCE_X, N // 2, 0)
        )
    )
    objects, arrays, _, config, _ = fdtdx.place_objects(
        object_list=[volume, source, *boundaries.values()],
        config=config,
        constraints=constraints,
        key=jax.random.PRNGKey(0),
    )
    return objects, arrays.reset(), config


def loss_fn(steps: int, pml: bool, method: str):
    """Minus the field energy in the box after ``steps`` steps (to minimise)."""
    objects, arrays, config = build(steps, pml)
    step = functools.partial(
        forward, config=config, objects=objects, key=jax.random.PRNGKey(0),
        record_detectors=True, record_boundaries=False, simulate_boundaries=True,
    )  # fmt: skip

    def body(state, _):
        return step(state), None

    def loss(design):
        eps = 1.0 + 3.0 * jax.nn.sigmoid(design)
        inv = arrays.inv_permittivities.at[0, DESIGN[0], DESIGN[1], :].set(1.0 / eps)
        init = (jnp.asarray(0, jnp.int32), arrays.aset("inv_permittivities", inv))
        if method == "reference":  # fdtdx's checkpointed_fdtd's program
            (_, final), _ = jax.lax.scan(jax.checkpoint(body), init, None, steps)
        else:
            (_, final), _ = revnet.scan(body, init, None, length=steps, mode=method)
        e, h = final.fields.E, final.fields.H
        box = (slice(None), BOX[0], BOX[1], slice(None))
        return -(jnp.sum(e[box] ** 2) + jnp.sum(h[box] ** 2))

    return loss


def temp_bytes(fn, *args) -> int:
    """Compiled temp memory of ``jit(fn)`` (not run)."""
    return int(jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes)


def relative(a, b) -> float:
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    steps = args.steps or (400 if args.smoke else 2_000)
    updates = args.updates or (2 if args.smoke else 4)
    design = 0.3 * jax.random.normal(jax.random.PRNGKey(1), (4, 4, 1))
    print(f"{steps:,} steps of fdtdx's FDTD update on a {N} x {N} plane")
    results: dict = {"config": {"steps": steps, "smoke": args.smoke}}

    grad = {m: jax.grad(loss_fn(steps, False, m)) for m in ("invert", "reference")}
    rel = relative(jax.jit(grad["invert"])(design), jax.jit(grad["reference"])(design))
    print(f"periodic: gradient, revnet invert vs jax.checkpoint: {rel:.1e} relative")
    memory: dict = {}
    for n in (steps // 4, steps):
        for m, name in (("invert", "revnet"), ("reference", "checkpoint")):
            fn = jax.grad(loss_fn(n, False, m))
            memory.setdefault(name, {})[str(n)] = temp_bytes(fn, design)
        print(
            f"periodic: temp memory of jit(grad(loss)), {n:,} steps: revnet "
            f"{memory['revnet'][str(n)]:,} B, jax.checkpoint "
            f"{memory['checkpoint'][str(n)]:,} B"
        )
    results.update(grad_rel_diff=rel, memory=memory)

    with warnings.catch_warnings(record=True) as seen:  # the check's one line
        warnings.simplefilter("always", revnet.DriftWarning)
        try:
            grad = jax.jit(jax.grad(loss_fn(steps, True, "invert")))
            jax.block_until_ready(grad(design))
            jax.effects_barrier()
            error = ""
        except jax.errors.JaxRuntimeError as err:  # with run-time checks on
            error = str(err).strip().splitlines()[-1]
    said = [str(w.message) for w in seen if w.category is revnet.DriftWarning]
    refused = said[0] if said else error
    print(f"PML, inverted: {refused[:150] + '...' if refused else 'not refused'}")
    pml = {
        m: jax.jit(jax.grad(loss_fn(steps, True, m)))
        for m in ("checkpoint", "reference")
    }
    pml_rel = relative(pml["checkpoint"](design), pml["reference"](design))
    print(f"PML, mode='checkpoint': gradient vs jax.checkpoint: {pml_rel:.1e} relative")
    results.update(pml_invert_refused=bool(refused), pml_grad_rel_diff=pml_rel)

    step = jax.jit(jax.value_and_grad(loss_fn(steps, False, "invert")))
    losses = []
    for i in range(updates):
        value, g = step(design)
        design = design - LR * g / jnp.max(jnp.abs(g))
        losses.append(float(value))
        print(f"update {i}: energy in the box {-value:.4g}")
    results["losses"] = losses
    if args.out:
        _durable.write_json(os.path.join(args.out, "fdtd_design.json"), results)
    return results


if __name__ == "__main__":
    try:
        main()
    except OSError as err:  # writing the results failed: one line, exit 1
        _flags.fail(err)
