"""The thread pool of forced CPU devices (``tests.helpers.subprocess_env``).

XLA:CPU runs each device's part of a program on a pool of max(cores, devices)
threads. A launch that waits for a free in-flight slot of its device blocks a
pool thread, so with 8 devices on a loaded machine the next program's launches
can hold threads that the running program's collective needs, and the process
hangs until XLA aborts it. This is plain JAX; ``PJRT_NPROC`` (twice the
devices) sizes the pool so that it cannot happen.
"""

from __future__ import annotations

import shutil
import textwrap

import pytest

from tests.helpers import THREADS_PER_DEVICE, run_python

pytestmark = pytest.mark.slow  # 8-device subprocesses

# Many small sharded programs with an all-reduce each, dispatched without
# waiting, so that launches queue up behind the running collective.
_DISPATCH = textwrap.dedent(
    """
    import os

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    f = jax.jit(lambda y: jnp.sin(y) + jnp.sum(y) * 1e-3)
    g = jax.jit(lambda y: y * 2.0)
    x = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P("data", None)))
    for _ in range(20):
        y = x
        for i in range(500):
            y = f(y) if i % 2 else g(y)
        float(jnp.sum(y))
    names = [
        open(f"/proc/self/task/{t}/comm").read().strip()
        for t in os.listdir("/proc/self/task")
    ]
    # The client's two pools have the same size; the intra-op one is named.
    print(sum(n == "tf_XLAEigen" for n in names))
    """
)


def test_the_pool_has_two_threads_per_device_and_many_launches_finish():
    # On one core the race is as likely as it gets: without PJRT_NPROC this
    # program hung in 4 runs of 4 here. XLA aborts a collective that waits
    # more than 600 s (tests.helpers.COLLECTIVE_PATIENCE): the run fails.
    launcher = ("taskset", "-c", "0") if shutil.which("taskset") else ()
    out = run_python("-c", _DISPATCH, launcher=launcher)
    assert int(out.split()[-1]) == THREADS_PER_DEVICE * 8, out
