"""jax-md's soft spheres in every revnet configuration, 1k and 10k steps.

Eight particles in the plane, soft-sphere repulsion (jax-md's
``energy.soft_sphere_pair``) in a harmonic trap, free space. Three steps:
jax-md's own ``simulate.nve`` step unchanged (its state carries the force,
which the step overwrites: a derived leaf, rebuilt from the positions by the
step before); a velocity Verlet on ``(R, p)`` that takes jax-md's force at the
start of the step; and the same in exact mode (``revnet.exact.add``). In a
periodic box jax-md's shift wraps the positions, and inverting is refused with
jax-md's line, the user's, and the rewrite named.
Gradients are with respect to the initial positions and ``sigma``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import revnet
from revnet import exact
from revnet._engine.loops.hooks import modes_chosen
from tests.simulation import peers

jax_md = peers.require("jax_md")
from jax_md import energy, quantity, simulate, space  # noqa: E402

N, DT, TRAP, KT = 8, 5e-3, 0.2, 0.5


def _params(dtype):
    g = (np.arange(3) + 0.5) * 1.1
    r = np.stack(np.meshgrid(g, g), -1).reshape(-1, 2)[:N]
    r = r + 0.05 * np.random.RandomState(0).randn(N, 2)
    return {"R0": jnp.asarray(r, dtype), "sigma": jnp.asarray(1.0, dtype)}


def _momenta(dtype):
    p = np.random.RandomState(1).randn(N, 2) * np.sqrt(KT)
    return jnp.asarray(p - p.mean(0), dtype)


def _energy(sigma):
    displacement, shift = space.free()
    soft = energy.soft_sphere_pair(displacement, sigma=sigma)
    return (
        lambda r, **kw: soft(r, **kw) + 0.5 * TRAP * jnp.sum((r - 1.65) ** 2)
    ), shift


def _nve_loss(steps):
    def loss(scan, params):
        energy_fn, shift = _energy(params["sigma"])
        init_fn, step_fn = simulate.nve(energy_fn, shift, dt=DT)
        dtype = params["R0"].dtype
        state = init_fn(
            jax.random.PRNGKey(0), params["R0"], KT, momenta=_momenta(dtype)
        )
        final, _ = scan(lambda s, _: (step_fn(s), None), state, None, length=steps)
        return jnp.sum(jnp.sin(final.position))

    return loss


def _verlet_loss(steps, bits=None):
    def loss(scan, params):
        energy_fn, shift = _energy(params["sigma"])
        force = quantity.force(energy_fn)
        dtype = params["R0"].dtype
        h = jnp.asarray(DT / 2, dtype)

        def add(x, d):
            return x + d if bits is None else exact.add(x, d, bits=bits)

        def step(carry, _):
            r, p = carry
            p = add(p, h * force(r))  # the force from r, at the start of the step
            r = add(r, 2 * h * p)  # free space: shift(r, dr) is r + dr
            p = add(p, h * force(r))
            return (r, p), None

        r0 = params["R0"] if bits is None else exact.grid(params["R0"], bits=bits)
        (r, _), _ = scan(step, (r0, _momenta(dtype)), None, length=steps)
        return jnp.sum(jnp.sin(r))

    return loss


def _nudge(params):
    return dict(params, R0=peers.nudged(params["R0"]))


FORMS = {"nve": _nve_loss, "verlet": _verlet_loss, "exact verlet": None}


@pytest.mark.slow
@pytest.mark.parametrize("steps", [1_000, 10_000])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("form", list(FORMS))
def test_every_configuration_gives_the_gradient_or_one_line(form, dtype, steps):
    with jax.enable_x64(dtype == "float64"):
        params = _params(dtype)
        if form == "exact verlet":
            loss = _verlet_loss(steps, bits=16)
        else:
            loss = FORMS[form](steps)
        outcomes = peers.check_all(loss, params, _nudge, anchor=100)
    by_mode = {}
    for options, result in outcomes.items():
        by_mode.setdefault(dict(options)["mode"], set()).add(result)
    # Not all refusals: checkpointing always gives the gradient, and every
    # step inverts where the rebuild is well conditioned (at 10,000 steps
    # rounding error grows past the check's tolerance in plain float
    # arithmetic, and the check says so).
    assert by_mode["checkpoint"] == {"within"}, outcomes
    if form == "exact verlet" or steps == 1_000:
        assert "within" in by_mode["invert"], outcomes


def test_the_unchanged_nve_step_inverts_with_the_force_derived():
    with modes_chosen() as seen:
        _nve_loss(3)(functools.partial(revnet.scan, mode="invert"), _params("float32"))
    (mode,) = seen
    assert mode.kind == "invert" and mode.stored == (False,) * 4, mode
    # the state's leaves: position, momentum, force, mass
    assert mode.derived.mask == (False, False, True, False), mode.derived.mask


def test_a_periodic_box_is_refused_with_jax_mds_line_and_the_rewrite_named():
    params = _params("float32")
    displacement, shift = space.periodic(4.0)
    energy_fn = energy.soft_sphere_pair(displacement, sigma=params["sigma"])
    init_fn, step_fn = simulate.nve(energy_fn, shift, dt=DT)
    state = init_fn(
        jax.random.PRNGKey(0), params["R0"], KT, momenta=_momenta("float32")
    )

    with pytest.raises(revnet.NotInvertibleError) as info:
        revnet.scan(
            lambda s, _: (step_fn(s), None), state, None, length=3, mode="invert"
        )
    first, hint = str(info.value).split("\n")
    assert "jax_md" in first and "space.py" in first and "`rem`" in first, first
    assert f"called from {__file__}:" in first, first
    assert hint.startswith("try: carry unwrapped coordinates"), hint
