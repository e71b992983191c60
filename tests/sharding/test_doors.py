"""``activation_sharding`` through every front door, on an 8-device mesh.

The cross-door table's sharding row (``tests/doors/test_table.py`` holds the
others): each door's stack of couplings, with the stream constrained to
``P("data")`` on a 4 x 2 mesh under Auto and Explicit axes, must give the
loss, the new state and every gradient leaf of the same stack run unsharded
under ordinary autodiff, keep its output sharded over ``data``, and constrain
the stream at every layer (constraints on the layer's input and output in
the body of the loop over layers, besides the one on the stack's input).
Runs in a fresh subprocess with 8 forced CPU devices
(``tests.sharding.test_sharding._run``).
"""

from __future__ import annotations

import pytest

from tests.sharding.test_sharding import _run

pytestmark = pytest.mark.slow  # an 8-device subprocess


def test_activation_sharding_in_every_door():
    out = _run(
        """
    import importlib
    from tests.helpers import assert_trees_close, equations, tolerance
    from tests.doors.test_table import DOORS, train_step

    DEPTH = 3
    CONSTRAINTS = {"sharding_constraint", "reshard"}
    for name in DOORS:
        try:
            door = importlib.import_module(f"tests.doors.adapters.{name}")
        except Exception as e:  # a door whose framework is missing
            print("skipped", name, e)
            continue
        want = train_step(door.build(DEPTH, dtype=jnp.float32, reversible=False))
        for mode, mesh in (("auto", AUTO), ("explicit", EXPLICIT)):
            with jax.set_mesh(mesh):
                built = door.build(
                    DEPTH,
                    dtype=jnp.float32,
                    reversible=True,
                    activation_sharding=P("data"),
                )
                x = jax.device_put(built.x, NamedSharding(mesh, P("data")))
                built = built._replace(x=x)
                got = train_step(built)
                eqns = equations(
                    built.apply, built.params, built.state, x, jax.random.PRNGKey(1)
                )
            what = f"{name} {mode}"
            rtol = tolerance(jnp.float32, loops=True)
            assert_trees_close(got["loss"], want["loss"], rtol, what + " loss")
            assert_trees_close(got["grads"], want["grads"], rtol, what + " grads")
            assert_trees_close(got["state"], want["state"], rtol, what + " state")
            assert got["y"].sharding.spec[0] == "data", (what, got["y"].sharding)
            n = sum(e.primitive.name in CONSTRAINTS for e in eqns)
            assert n >= 3, (what, n)  # the input, each layer's input and output
            print("checked", what, n)
    """
    )
    assert out.count("checked") == 6, out[-2000:]
