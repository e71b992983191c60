"""The standalone examples: smoke runs, resumption, and their saved state."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys

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
        assert all(r["grad_max_abs_diff"] < 1e-5 for r in results["history"])
        assert set(results["temp_bytes"]) == {"reversible", "standard"}
    else:
        assert len(results["losses"]) == 3 and results["memory"]


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
    assert bpd["reversible"] <= bpd["standard"] + 1e-4, bpd
    assert temp["reversible"] < temp["standard"], temp
    assert results["samples_finite"]
    assert (tmp_path / "flow_digits.png").stat().st_size > 0


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
