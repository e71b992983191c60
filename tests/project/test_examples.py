"""The standalone examples: smoke runs, resumption, and their saved state."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers import ROOT, load_example

EXAMPLES = os.path.join(ROOT, "examples")
SCRIPTS = ("digits", "while_loop")


state = load_example("_state", "examples_state")


def run_example(script: str, *flags: str, env: dict | None = None) -> str:
    """Runs ``examples/<script>.py`` in a subprocess; returns its stdout."""
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, f"{script}.py"), *flags],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def run_bad(*argv: str, **kwargs) -> subprocess.CompletedProcess:
    """Runs ``python *argv`` in the repository; it must end within 30 s."""
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        **kwargs,
    )
    assert time.monotonic() - start < 30
    return proc


def assert_one_line_error(proc: subprocess.CompletedProcess, code: int, prog: str):
    """Exit status ``code``, one line on stderr, no traceback, nothing run."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), lines[:5]
    assert "Traceback" not in proc.stderr


# digits' training split: what --batch is checked against.
N_TRAIN = 1797 - 360
BAD_DIGITS_FLAGS = [
    ["--epochs", "0"],
    ["--epochs", "-2"],
    ["--epochs", "ten"],
    ["--lr", "nan"],
    ["--lr", "inf"],
    ["--lr", "0"],
    ["--lr", "-0.1"],
    ["--batch", "0"],
    ["--batch", "5000"],
    ["--batch", str(N_TRAIN + 1)],
    ["--seed", "-1"],
    ["--out", "/proc/not-writable"],
    ["--out", "FILE"],  # a regular file
]


def test_digits_training_split_is_what_batch_is_checked_against():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images = np.arange(len(load_digits().target))
    train = train_test_split(images, test_size=0.2, random_state=0)[0]
    assert len(images) == 1797 and len(train) == N_TRAIN


@pytest.mark.parametrize("entry", ["examples/digits.py", "-m experiments.train"])
@pytest.mark.parametrize("flags", BAD_DIGITS_FLAGS, ids=" ".join)
def test_bad_flags_end_at_once_with_one_line(entry, flags, tmp_path):
    """Exit status 2 and one line, before anything is trained or written."""
    (tmp_path / "FILE").write_text("")
    flags = [str(tmp_path / f) if f == "FILE" else f for f in flags]
    proc = run_bad(*entry.split(), "--smoke", *flags)
    assert_one_line_error(proc, 2, "digits.py")
    assert proc.stdout == ""  # nothing compiled, nothing trained
    assert flags[0][2:] in proc.stderr
    if flags[0] == "--batch" and int(flags[1]) > N_TRAIN:
        assert f"the {N_TRAIN} training images" in proc.stderr


OTHER_BAD_FLAGS = [
    ("digits_eqx", "--lr", "nan"),
    ("digits_eqx", "--batch", "1798"),
    ("digits_eqx", "--width", "0"),
    ("digits_nnx", "--depth", "0"),
    ("flow_digits", "--out", "/proc/not-writable"),
    ("flow_digits", "--batch", str(N_TRAIN + 1)),
    ("flow_digits", "--steps", "0"),
    ("while_loop", "--steps", "-1"),
    ("while_loop", "--out", "/proc/not-writable"),
    ("exact_leapfrog", "--steps", "0"),
    ("exact_leapfrog", "--bits", "21"),
    ("exact_leapfrog", "--out", "/proc/not-writable"),
    ("sharded_training", "--data", "3"),
    ("sharded_training", "--layers", "0"),
    ("md_nve", "--steps", "0"),
    ("md_nve", "--out", "/proc/not-writable"),
    ("neural_ode_heun", "--updates", "-1"),
    ("neural_ode_heun", "--out", "/proc/not-writable"),
    ("fdtd_design", "--steps", "zero"),
]


@pytest.mark.parametrize("script, flag, value", OTHER_BAD_FLAGS)
def test_the_other_examples_bad_flags_end_at_once(script, flag, value):
    proc = run_bad(os.path.join(EXAMPLES, f"{script}.py"), flag, value)
    assert_one_line_error(proc, 2, f"{script}.py")
    assert proc.stdout == ""


@pytest.mark.slow
def test_a_failed_save_ends_training_with_one_line(tmp_path):
    """Files over 1 KiB cannot be written (RLIMIT_FSIZE; the --out check
    passes): orbax's save fails inside its threads, and the run ends at once
    with one line and exit status 1, no traceback and no hang."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))

    out = str(tmp_path / "out")
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.train", "--tiny", "--epochs", "1"]
        + ["--out", out],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=limit,
    )
    assert_one_line_error(proc, 1, "digits.py")
    assert "cannot save step 1" in proc.stderr and "File too large" in proc.stderr
    assert "epoch 1:" in proc.stdout  # it trained, then failed to save
    assert time.monotonic() - start < 300
    assert state.steps(os.path.join(out, "state")) == []


def test_examples_are_short():
    for name in os.listdir(EXAMPLES):
        if name.endswith(".py"):
            with open(os.path.join(EXAMPLES, name)) as f:
                assert len(f.readlines()) <= 200, name


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_smoke_run_writes_json(script, tmp_path):
    run_example(script, "--smoke", "--out", str(tmp_path))
    with open(tmp_path / f"{script}.json") as f:
        results = json.load(f)
    if script == "digits":
        assert [r["epoch"] for r in results["history"]] == [1, 2]
        # absolute, float32 training
        assert all(r["grad_max_abs_diff"] < 1e-5 for r in results["history"])
        assert set(results["temp_bytes"]) == {"reversible", "standard"}
    else:
        assert len(results["losses"]) == 3 and results["memory"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, package, peer",
    [
        ("md_nve", "jax_md", "checkpoint"),
        ("neural_ode_heun", "diffrax", "diffrax"),
        ("fdtd_design", "fdtdx", "checkpoint"),
    ],
)
def test_a_simulation_example_inverts_a_peers_step_in_flat_memory(
    script, package, peer, tmp_path
):
    """The peer's own step, inverted: the gradient is the peer's method's, the
    backward pass's memory is the same at 100 and 1,000 steps and below the
    peer's, and the fit improves."""
    pytest.importorskip(
        package, reason="the simulation extra: pip install -e '.[simulation]'"
    )
    run_example(script, "--smoke", "--out", str(tmp_path))
    with open(tmp_path / f"{script}.json") as f:
        results = json.load(f)
    # float32 simulations over many steps: far looser than the table's
    assert results["grad_rel_diff"] < 1e-3, results["grad_rel_diff"]
    memory = results["memory"]
    lo, hi = sorted(memory["revnet"], key=int)
    assert memory["revnet"][lo] == memory["revnet"][hi], memory
    assert memory["revnet"][hi] < memory[peer][hi], memory
    losses = results["losses"]
    assert len(losses) == 2 and losses[1] < losses[0], losses
    if script == "fdtd_design":  # PML: refused aloud, then checkpointed
        assert results["pml_invert_refused"] is True
        # as above, checkpointed
        assert results["pml_grad_rel_diff"] < 1e-3, results["pml_grad_rel_diff"]


@pytest.mark.slow
def test_flow_digits_smoke_run(tmp_path):
    """The flow's twins train alike (equal to float32 rounding after the same
    steps: the reversible twin's test bits per dimension is no worse), the
    reversible twin's step holds less memory, and the samples are drawn."""
    run_example("flow_digits", "--smoke", "--out", str(tmp_path))
    with open(tmp_path / "flow_digits.json") as f:
        results = json.load(f)
    bpd, temp = results["bits_per_dim"], results["temp_bytes"]
    assert 0 < bpd["reversible"] < 8, bpd
    assert bpd["reversible"] <= bpd["standard"] + 1e-4, bpd  # float32 bits/dim
    assert temp["reversible"] < temp["standard"], temp
    assert results["samples_finite"]
    assert (tmp_path / "flow_digits.png").stat().st_size > 0


def test_exact_leapfrog_rebuilds_bit_for_bit_in_flat_memory():
    """1,000 exact steps are undone bit for bit (plain float32 ones are not),
    and the gradient's temp memory is the same at 1,000 and 100,000 steps
    (compiled only)."""
    import jax
    import jax.numpy as jnp

    lf = load_example("exact_leapfrog")
    kq, kp, kt, kw = jax.random.split(jax.random.PRNGKey(0), 4)
    q0, p0 = (lf.exact.grid(jax.random.normal(k, (4, 2)), bits=16) for k in (kq, kp))
    target, params = jax.random.normal(kt, (4, 2)), lf.init_mlp(kw)
    q, p = lf.rebuild(params, q0, p0, 1000, 16)
    np.testing.assert_array_equal(np.asarray(q), np.asarray(q0))
    np.testing.assert_array_equal(np.asarray(p), np.asarray(p0))
    q, p = lf.rebuild(params, q0, p0, 1000, None)
    assert float(jnp.max(jnp.abs(q - q0)) + jnp.max(jnp.abs(p - p0))) > 0
    temp = [lf.temp_bytes(params, q0, p0, target, n, 16) for n in (1000, 100_000)]
    assert temp[0] == temp[1] > 0, temp


@pytest.mark.slow
def test_exact_leapfrog_smoke_run(tmp_path):
    """10,000 steps rebuilt bit for bit, float32 not; the gradient equal to
    lax.scan's to float32 rounding; temp memory flat in the steps."""
    log = run_example("exact_leapfrog", "--smoke", "--out", str(tmp_path))
    assert "exact leapfrog: initial state rebuilt bit for bit: True" in log, log
    with open(tmp_path / "exact_leapfrog.json") as f:
        results = json.load(f)
    assert results["config"]["steps"] == 10_000
    assert results["exact_rebuilt_bitwise"] and results["exact_rebuild_error"] == 0
    assert not results["float_rebuilt_bitwise"] and results["float_rebuild_error"] > 0
    assert results["grads_max_rel_diff"] < 1e-4, results  # float32, 10,000 steps
    assert results["temp_bytes"]["1000"] == results["temp_bytes"]["100000"] > 0
    assert all(np.isfinite(results["losses"])) and len(results["losses"]) == 1


@pytest.mark.slow
def test_interrupted_digits_run_resumes_exactly(tmp_path):
    # The compilation cache only saves time; the resumed run recompiles alike.
    env = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache")}
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    resumed, straight = str(tmp_path / "resumed"), str(tmp_path / "straight")
    run_example("digits", "--smoke", "--epochs", "2", "--out", resumed, env=env)
    assert state.steps(os.path.join(resumed, "state")) == [1, 2]
    log = run_example("digits", "--smoke", "--epochs", "3", "--out", resumed, env=env)
    assert "resuming after epoch 2" in log and "epoch 1:" not in log, log
    run_example("digits", "--smoke", "--epochs", "3", "--out", straight, env=env)
    trees = [state.load(os.path.join(d, "state"), 3) for d in (resumed, straight)]
    (tree_a, meta_a), (tree_b, meta_b) = trees
    import jax

    leaves_a, leaves_b = jax.tree.leaves(tree_a), jax.tree.leaves(tree_b)
    assert len(leaves_a) == len(leaves_b) > 0
    for a, b in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert meta_a == meta_b
    for d in (resumed, straight):
        with open(os.path.join(d, "digits.json")) as f:
            assert [r["epoch"] for r in json.load(f)["history"]] == [1, 2, 3]


TREE = {
    "params": {
        "linear": {
            "w": np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
            "b": np.full(4, -0.0, np.float32),
        },
        "count": np.array(3, np.int32),
    },
    "momentum": (np.linspace(0, 1, 5, dtype=np.float32),),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("state"))
    state.save(directory, 1, TREE, {"epoch": 1})
    return directory


@pytest.fixture
def copy(saved, tmp_path):
    directory = str(tmp_path / "state")
    shutil.copytree(saved, directory)
    return directory


def _files(directory, step=1):
    """The files of ``step``'s data folder, largest first, then its record."""
    record = os.path.join(directory, f"step_{step:06d}.json")
    with open(record) as f:
        data = os.path.join(directory, json.load(f)["data"])
    found = [os.path.join(r, n) for r, _, ns in os.walk(data) for n in ns]
    return sorted(found, key=os.path.getsize, reverse=True) + [record]


def test_state_round_trips_exactly(copy):
    tree, meta = state.load(copy, 1, TREE)
    assert meta == {"epoch": 1}
    import jax

    assert jax.tree.structure(tree) == jax.tree.structure(TREE)
    for got, want in zip(jax.tree.leaves(tree), jax.tree.leaves(TREE)):
        got = np.asarray(got)
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes()


def test_state_refuses_a_flipped_byte_in_any_file(copy):
    for path in _files(copy):
        with open(path, "rb") as f:
            data = bytearray(f.read())
        data[len(data) // 2] ^= 0x01
        with open(path, "wb") as f:
            f.write(data)
        with pytest.raises(state.StateError, match="SHA-256|not a state record"):
            state.load(copy, 1, TREE)
        data[len(data) // 2] ^= 0x01
        with open(path, "wb") as f:
            f.write(data)
    state.load(copy, 1, TREE)  # restored: fine again


@pytest.mark.parametrize("which", [0, -1])  # the largest data file; the record
def test_state_refuses_a_truncated_file(copy, which):
    path = _files(copy)[which]
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(state.StateError, match="SHA-256|not a state record"):
        state.load(copy, 1, TREE)


class _Trap:
    """Unpickling this would create ``path``."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("which", [0, -1])
def test_state_refuses_a_pickle_and_runs_nothing(copy, tmp_path, which):
    marker = tmp_path / "executed"
    with open(_files(copy)[which], "wb") as f:
        pickle.dump(_Trap(str(marker)), f)
    with pytest.raises(state.StateError, match="SHA-256|not a state record"):
        state.load(copy, 1, TREE)
    assert not marker.exists()


def test_state_refuses_another_tree(copy):
    other = {**TREE, "momentum": (np.zeros(6, np.float32),)}
    with pytest.raises(state.StateError, match="does not match|unreadable"):
        state.load(copy, 1, other)
