"""revnet in a multi-process JAX run: 2 processes on this machine, 4 CPU devices each.

Each test starts its worker processes (``_WORKER``) with
``jax.distributed.initialize`` on a free loopback port and gloo CPU collectives;
they build one global 4 x 2 ``("data", "model")`` mesh over the 8 devices with
``jax.set_mesh`` and write what they saw to ``np.savez`` files, which the test
compares. Every process is killed if the run takes longer than its limit, so a
hang fails the test instead of blocking the suite.

* Training a ``ReversibleTransformer`` on a batch sharded over ``data`` gives
  the losses and gradients of a one-process, one-device run on the same
  global batch, and the drift monitor warns, and records one reading per
  backward pass, in BOTH processes.
* A value that cannot be inverted at run time (a zero gain in the stream)
  raises ``NotInvertibleError`` in BOTH processes, and so does a drift monitor
  with ``on_exceed="raise"``; neither process hangs: a step given the failed
  step's outputs re-raises in both, and after each failure both run a regular
  step. Before, JAX ran the callback on device 0 only: process 0 raised,
  process 1 went on with NaN gradients (or past the drift), and the step after
  the failure hung in both, process 1's devices waiting in a collective for
  devices that had stopped.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers import ROOT, assert_trees_close, subprocess_env, tolerance

pytestmark = pytest.mark.slow  # multi-process runs

_ROOT = ROOT

_WORKER = '''
"""argv: process_id num_processes port out_dir mode mesh_kind."""
import os
import sys
import warnings

pid, nproc, port = map(int, sys.argv[1:4])
out_dir, mode, mesh_kind = sys.argv[4:7]

import jax

if nproc > 1:
    jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=nproc,
        process_id=pid,
        initialization_timeout=60,
    )

import haiku as hk
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import revnet
from revnet import blocks

warnings.simplefilter("always", revnet.DriftWarning)
B, T, D, STEPS = 8, 4, 16, 3
rng = np.random.RandomState(0)
X = rng.normal(size=(B, T, D)).astype(np.float32)
Y = rng.normal(size=(B, T, D)).astype(np.float32)
results = {}


def log(*args):
    print(f"[process {pid}]", *args, flush=True)


if nproc > 1:
    assert jax.process_count() == nproc and jax.device_count() == 4 * nproc
    axis_type = AxisType.Explicit if mesh_kind == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
    jax.sharding.set_mesh(mesh)
    batch = NamedSharding(mesh, P("data"))
    replicated = NamedSharding(mesh, P())

    def put(a):
        # This process's rows of the global batch, as in a real data loader.
        rows = batch.addressable_devices_indices_map(a.shape).values()
        lo, hi = min(r[0].start for r in rows), max(r[0].stop for r in rows)
        return jax.make_array_from_process_local_data(batch, a[lo:hi], a.shape)

    def host(tree):
        return jax.tree.map(
            np.asarray, multihost_utils.process_allgather(tree, tiled=True)
        )
else:
    put, replicated = jnp.asarray, None

    def host(tree):
        return jax.tree.map(np.asarray, tree)


def transformer(monitor):
    def net(x):
        return blocks.ReversibleTransformer(
            2, 2, D, 32, anchor_every=1, drift=monitor
        )(x, False)

    return hk.without_apply_rng(hk.transform(net))


def zero_gain():
    # The stream is multiplied by a parameter; at 0 its inverse divides by 0.
    def block(h):
        f = lambda a: jnp.tanh(hk.Linear(D // 2)(a))  # noqa: E731
        h = blocks.AdditiveCoupling(f, f)(h)
        return h * hk.get_parameter("gain", [D], init=jnp.ones)

    return hk.without_apply_rng(hk.transform(
        lambda x: blocks.ReversibleSequence(block, 2)(x)
    ))


def trainer(model, params):
    # SGD: Adam would turn the rounding noise of gradients that are zero in
    # theory (attention key biases) into steps of the full learning rate.
    opt = optax.sgd(0.1)

    @jax.jit
    def step(p, s, x, y):
        def loss_fn(p):
            return jnp.mean(jnp.square(model.apply(p, x) - y))

        loss, g = jax.value_and_grad(loss_fn)(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss, g

    return step, jax.jit(opt.init)(params)


x, y = put(X), put(Y)


def init(model):
    return jax.jit(model.init, out_shardings=replicated)(jax.random.key(0), x)


def attempt(name, step, params, opt_state):
    """Runs one step; records its error message (or '') under ``name``.

    Returns the step's outputs, which hold the error if it failed (as in a
    training loop that catches the error and goes on with the next batch).
    """
    out = None
    try:
        out = step(params, opt_state, x, y)
        jax.block_until_ready(out)
        results[name] = np.array("")
    except Exception as e:  # noqa: BLE001 - recorded and compared by the test
        results[name] = np.array(f"{type(e).__name__}: {e}")
        log(name, "raised", type(e).__name__)
    return out


if mode == "train":
    monitor = revnet.DriftMonitor(tolerance=1e-12, on_exceed="warn")
    model = transformer(monitor)
    params = init(model)
    step, opt_state = trainer(model, params)
    for i in range(STEPS):
        params, opt_state, loss, g = step(params, opt_state, x, y)
        results[f"loss {i}"] = host(loss)
        for path, leaf in jax.tree_util.tree_leaves_with_path(host(g)):
            results[f"grad {i} {jax.tree_util.keystr(path)}"] = leaf
        log("step", i, "loss", float(results[f"loss {i}"]))
    jax.effects_barrier()
    results["readings"] = np.array(len(monitor.readings))
else:  # failures, each followed by a regular step
    ok = transformer(None)
    ok_params = init(ok)
    ok_step, ok_state = trainer(ok, ok_params)
    attempt("regular 0", ok_step, ok_params, ok_state)

    bad = zero_gain()
    params = init(bad)
    params = {
        m: {n: jnp.zeros_like(v) if n == "gain" else v for n, v in d.items()}
        for m, d in params.items()
    }
    bad_step, bad_state = trainer(bad, params)
    params, bad_state, _, _ = attempt("zero gain", bad_step, params, bad_state)
    # Going on from the failed step's outputs: if only some devices had
    # stopped, the others' next collective would wait for them for ever.
    attempt("zero gain, next step", bad_step, params, bad_state)
    attempt("regular 1", ok_step, ok_params, ok_state)

    strict = transformer(revnet.DriftMonitor(tolerance=1e-12, on_exceed="raise"))
    strict_step, strict_state = trainer(strict, ok_params)
    attempt("drift", strict_step, ok_params, strict_state)
    attempt("regular 2", ok_step, ok_params, ok_state)

np.savez(os.path.join(out_dir, f"{mode}_{pid}_of_{nproc}.npz"), **results)
if nproc > 1:
    # Explicitly: JAX's exit handler re-raises a callback's error and then
    # skips the shutdown, which aborts the coordinator's process.
    jax.distributed.shutdown()
log("done")
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, runs, limit: float) -> list[str]:
    """Starts ``runs`` ((process_id, num_processes, mode, mesh_kind, port)),
    waits for all of them for at most ``limit`` seconds in total, kills them
    all otherwise, and returns each one's output."""
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    env = subprocess_env(None, REVNET_RUNTIME_CHECKS="1", JAX_PLATFORMS="cpu")
    procs, logs = [], []
    try:
        for n, (pid, nproc, mode, mesh_kind, port) in enumerate(runs):
            log = open(tmp_path / f"log{n}.txt", "w+")
            logs.append(log)
            args = [pid, nproc, port, tmp_path, mode, mesh_kind]
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), *map(str, args)],
                    cwd=_ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        deadline = time.monotonic() + limit
        for p in procs:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        hung = [n for n, p in enumerate(procs) if p.poll() is None]
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    for n, p in enumerate(procs):
        assert n not in hung, f"process {n} still running after {limit} s:\n" + (
            "\n".join(f"--- {k}:\n{o[-3000:]}" for k, o in enumerate(outputs))
        )
        assert p.returncode == 0, f"process {n} failed:\n{outputs[n][-6000:]}"
    return outputs


def _load(tmp_path, mode: str, pid: int, nproc: int) -> dict:
    with np.load(tmp_path / f"{mode}_{pid}_of_{nproc}.npz") as f:
        return {k: f[k] for k in f.files}


@pytest.mark.parametrize("mesh_kind", ["explicit", "auto"])
def test_two_processes_train_like_one(tmp_path, mesh_kind):
    port = _free_port()
    outputs = _launch(
        tmp_path,
        [
            (0, 2, "train", mesh_kind, port),
            (1, 2, "train", mesh_kind, port),
            (0, 1, "train", "none", 0),  # the reference: one process, one device
        ],
        limit=300,
    )
    want = _load(tmp_path, "train", 0, 1)
    got = [_load(tmp_path, "train", pid, 2) for pid in (0, 1)]
    assert got[0].keys() == want.keys()
    for k in want:  # both processes read the same global values
        np.testing.assert_array_equal(got[0][k], got[1][k], err_msg=k)
    for i in range(3):
        for prefix in (f"loss {i}", f"grad {i} "):
            g = {k: v for k, v in got[0].items() if k.startswith(prefix)}
            w = {k: v for k, v in want.items() if k.startswith(prefix)}
            assert_trees_close(g, w, tolerance("float32"), prefix)
    # The drift monitor of every process gets one reading per backward pass
    # and warns (its tolerance is below float32 rounding).
    for pid in (0, 1):
        assert int(got[pid]["readings"]) == 3
        assert outputs[pid].count("DriftWarning") == 3, outputs[pid][-3000:]


@pytest.mark.parametrize("mesh_kind", ["explicit", "auto"])
def test_failures_raise_on_every_process_and_nobody_hangs(tmp_path, mesh_kind):
    port = _free_port()
    _launch(
        tmp_path,
        [(0, 2, "fail", mesh_kind, port), (1, 2, "fail", mesh_kind, port)],
        limit=120,
    )
    for pid in (0, 1):
        got = {k: str(v) for k, v in _load(tmp_path, "fail", pid, 2).items()}
        assert "NotInvertibleError" in got["zero gain"], got["zero gain"]
        assert "non-finite value" in got["zero gain"], got["zero gain"]
        assert "DriftError" in got["drift"], got["drift"]
        assert "exceeds the tolerance" in got["drift"], got["drift"]
        # The next step is given the failed step's outputs: it re-raises.
        assert "NotInvertibleError" in got["zero gain, next step"]
        for n in range(3):
            assert got[f"regular {n}"] == "", got[f"regular {n}"]
