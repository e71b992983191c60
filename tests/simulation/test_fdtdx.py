"""fdtdx's own FDTD step in every revnet configuration, 1k and 10k steps.

A 16 x 16 cell plane (periodic along z) with a point dipole, a dielectric
design region (the parameters) and the field energy in a detector box at the
end. The step is fdtdx's ``fdtd.forward.forward``, bound as fdtdx's own
``checkpointed_fdtd`` binds it, unchanged; its carry is fdtdx's state. With
periodic boundaries the step inverts; with PML its damping is undone by
dividing by a factor below 1 at every reversed step, and the boundary check
says so in one line. The reference is ``jax.checkpoint`` over ``lax.scan``
of the step, which is fdtdx's ``checkpointed_fdtd``'s program.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

import revnet
from revnet._engine.loops.hooks import modes_chosen
from tests.helpers import temp_bytes
from tests.simulation import peers

fdtdx = peers.require("fdtdx")
from fdtdx.fdtd.forward import forward  # noqa: E402

N, PML, SPACING = 16, 4, 100e-9
DESIGN, BOX, SOURCE_X = (slice(6, 10), slice(6, 10)), (slice(11, 13), slice(6, 10)), 4


def _build(steps, dtype, pml):
    probe = fdtdx.SimulationConfig(
        time=1e-15, grid=fdtdx.UniformGrid(spacing=SPACING), backend="cpu", dtype=dtype
    )
    config = fdtdx.SimulationConfig(
        time=steps * probe.time_step_duration,
        grid=fdtdx.UniformGrid(spacing=SPACING),
        backend="cpu",
        dtype=dtype,
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


def _loss(steps, dtype, pml):
    objects, arrays, config = _build(steps, dtype, pml)
    step_fn = functools.partial(
        forward,
        config=config,
        objects=objects,
        key=jax.random.PRNGKey(0),
        record_detectors=True,
        record_boundaries=False,
        simulate_boundaries=True,
    )
    base = arrays.inv_permittivities

    def loss(scan, design):
        eps = 1.0 + 3.0 * jax.nn.sigmoid(design)
        inv = base.at[0, DESIGN[0], DESIGN[1], :].set((1.0 / eps).astype(base.dtype))
        init = (jnp.asarray(0, jnp.int32), arrays.aset("inv_permittivities", inv))
        (_, final), _ = scan(lambda s, _: (step_fn(s), None), init, None, length=steps)
        e, h = final.fields.E, final.fields.H
        return jnp.sum(e[:, BOX[0], BOX[1], :] ** 2) + jnp.sum(
            h[:, BOX[0], BOX[1], :] ** 2
        )

    return loss


@pytest.mark.slow
@pytest.mark.parametrize("steps", [1_000, 10_000])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("pml", [False, True], ids=["periodic", "pml"])
def test_every_configuration_gives_the_gradient_or_one_line(pml, dtype, steps):
    with jax.enable_x64(dtype == "float64"):
        design = 0.3 * jax.random.normal(jax.random.PRNGKey(1), (4, 4, 1), dtype)
        loss = _loss(steps, getattr(jnp, dtype), pml)
        outcomes = peers.check_all(loss, design, peers.nudged, anchor=100)
    by_mode = {}
    for options, result in outcomes.items():
        by_mode.setdefault(dict(options)["mode"], set()).add(result)
    assert by_mode["checkpoint"] == {"within"}, outcomes
    if pml:
        assert by_mode["invert"] == {"refused"}, outcomes  # the damping, said
    elif steps == 1_000:
        assert by_mode["invert"] == {"within"}, outcomes


def test_the_periodic_step_inverts_in_flat_memory_with_the_default_options():
    """``revnet.scan`` with no options: fdtdx's step is inverted, nothing is
    stored per step (its ``jnp.stack``s are linear, its time slot is read
    from the integer step counter), and the compiled memory of the gradient is
    the same at 100 and 400 steps."""
    design = 0.3 * jax.random.normal(jax.random.PRNGKey(1), (4, 4, 1))
    with modes_chosen() as seen:
        report = revnet.stored(
            functools.partial(_loss(100, jnp.float32, False), revnet.scan), design
        )
    assert [m.kind for m in seen] == ["invert"], seen
    assert not [e for e in report.entries if e.steps], report.entries
    temp = [
        temp_bytes(
            jax.grad(functools.partial(_loss(n, jnp.float32, False), revnet.scan)),
            design,
        )
        for n in (100, 400)
    ]
    assert temp[0] == temp[1], temp
