"""The examples' saved state (``examples/_state.py``) under damage and races.

Every bit of the record and of the data is checked, a dtype is never cast, a
step is replaced atomically (a writer killed at any moment leaves the last
complete copy loadable) and two writers of one step both finish. The ``slow``
tests kill and race real writer processes.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from tests.helpers import ROOT, load_example

state = load_example("_state", "examples_state")
EXAMPLES = os.path.join(ROOT, "examples")


def tree(i: int = 0) -> dict:
    """A small state whose every value says ``i``."""
    return {
        "params": {"w": np.full((3, 4), i / 7, np.float32), "n": np.int32(i)},
        "momentum": (np.linspace(0, i, 5, dtype=np.float32),),
    }


def record_path(directory: str, step: int = 1) -> str:
    return os.path.join(directory, f"step_{step:06d}.json")


def data_files(directory: str, step: int = 1) -> list[str]:
    """The files of the data folder that ``step``'s record names."""
    with open(record_path(directory, step)) as f:
        data = os.path.join(directory, json.load(f)["data"])
    return sorted(os.path.join(r, n) for r, _, ns in os.walk(data) for n in ns)


def assert_loads_as(directory: str, i: int) -> None:
    """Step 1 loads, and its data and meta both say ``i``."""
    got, meta = state.load(directory, 1, tree())
    assert meta == {"i": i}
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(tree(i))):
        assert np.asarray(a).dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), b)


def test_every_flipped_bit_of_the_record_is_refused(tmp_path):
    """The record (meta included) is canonical JSON under its own SHA-256: a
    float's ``e`` read as ``E``, or a changed digit of meta, is refused too."""
    directory = str(tmp_path)
    meta = {"i": 3, "loss": 2.5e-06, "name": "caf\u00e9"}
    state.save(directory, 1, tree(3), meta)
    path = record_path(directory)
    with open(path, "rb") as f:
        raw = f.read()
    assert b"e-06" in raw and b"\\u00e9" in raw
    accepted, fd = [], os.open(path, os.O_RDWR)
    try:
        for i in range(len(raw)):
            for bit in range(8):
                os.pwrite(fd, bytes([raw[i] ^ (1 << bit)]), i)
                try:
                    state._record(directory, 1)
                    accepted.append((i, bit))
                except state.StateError:
                    pass
            os.pwrite(fd, raw[i : i + 1], i)
    finally:
        os.close(fd)
    assert not accepted, accepted[:5]
    got, got_meta = state.load(directory, 1, tree())
    assert got_meta == meta


def test_a_flipped_bit_in_any_data_file_is_refused(tmp_path):
    directory = str(tmp_path)
    state.save(directory, 1, tree(2), {"i": 2})
    files = data_files(directory)
    assert len(files) >= 4
    for path in files:
        with open(path, "rb") as f:
            raw = f.read()
        for where in sorted({0, len(raw) // 2, len(raw) - 1}):
            damaged = bytearray(raw)
            damaged[where] ^= 0x80 if where % 2 else 0x01
            with open(path, "wb") as f:
                f.write(damaged)
            with pytest.raises(state.StateError, match="SHA-256"):
                state.load(directory, 1, tree())
        with open(path, "wb") as f:
            f.write(raw)
    assert_loads_as(directory, 2)


@pytest.mark.parametrize("dtype", [np.float16, np.float64, np.int32])
def test_another_dtype_is_refused_not_cast(tmp_path, dtype):
    directory = str(tmp_path)
    state.save(directory, 1, tree(1), {"i": 1})
    other = tree()
    other["params"]["w"] = other["params"]["w"].astype(dtype)
    with pytest.raises(state.StateError, match="does not match.*float32"):
        state.load(directory, 1, other)
    assert_loads_as(directory, 1)


def test_a_replaced_step_leaves_one_folder_and_dead_writers_debris_goes(tmp_path):
    directory = str(tmp_path)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = "step_000001.999999999-0123abcd.orbax-checkpoint-tmp"
        live = f"step_000001.{sleeper.pid}-0123abcd"
        for name in (dead, live):
            os.makedirs(os.path.join(directory, name))
        state.save(directory, 1, tree(1), {"i": 1})
        state.save(directory, 1, tree(2), {"i": 2})
        assert_loads_as(directory, 2)
        with open(record_path(directory)) as f:
            named = json.load(f)["data"]
        # The first copy's folder, and the exited writer's, are gone; a
        # running writer's folder is left to it.
        assert sorted(os.listdir(directory)) == sorted(
            [named, "step_000001.json", live]
        )
    finally:
        sleeper.kill()
        sleeper.wait()


# A writer that saves step 1 over and over, each copy saying its number.
WRITER = """
import sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
import _state
directory, first, count = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
go = sys.argv[5] if len(sys.argv) > 5 else None
while go and not __import__("os").path.exists(go):
    time.sleep(0.01)
for i in range(first, first + count):
    tree = {
        "params": {"w": np.full((3, 4), i / 7, np.float32), "n": np.int32(i)},
        "momentum": (np.linspace(0, i, 5, dtype=np.float32),),
    }
    _state.save(directory, 1, tree, {"i": i})
    print(i, flush=True)
"""


def writer(directory: str, first: int, count: int, *go: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, EXAMPLES, directory, str(first), str(count)]
        + list(go),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_a_writer_killed_at_any_moment_leaves_the_step_loadable(tmp_path):
    """Six writers, each killed (SIGKILL) at a random moment while it saves
    step 1 again and again: the step loads every time, its data and meta from
    the same save, and the debris goes with the next save."""
    directory, rng, debris = str(tmp_path), random.Random(0), []
    state.save(directory, 1, tree(0), {"i": 0})
    last = 0
    for round_ in range(1, 7):
        proc = writer(directory, 1000 * round_, 10**6)
        try:
            assert proc.stdout.readline().strip() == str(1000 * round_)
            time.sleep(rng.uniform(0.0, 0.4))
        finally:  # killed even when it never printed its first step
            proc.send_signal(signal.SIGKILL)
            proc.communicate(timeout=30)
        _, meta = state.load(directory, 1, tree())
        assert meta["i"] >= 1000 * round_ > last
        last = meta["i"]
        assert_loads_as(directory, last)
        debris.append(len(os.listdir(directory)) > 2)
    assert any(debris)  # some kills did land in the middle of a save
    state.save(directory, 1, tree(7), {"i": 7})
    assert len(os.listdir(directory)) == 2  # the record and its folder
    assert_loads_as(directory, 7)


@pytest.mark.slow
def test_two_writers_of_one_step_both_finish_and_it_loads(tmp_path):
    directory, go = str(tmp_path / "state"), str(tmp_path / "go")
    procs = [writer(directory, first, 5, go) for first in (100, 200)]
    try:
        time.sleep(3)  # both are waiting, JAX and orbax imported
        # Both must end within 60 s of the start: a hang raises TimeoutExpired.
        deadline = time.monotonic() + 60
        open(go, "w").close()
        for proc in procs:
            left = max(0.0, deadline - time.monotonic())
            out, err = proc.communicate(timeout=left)
            assert proc.returncode == 0, err[-2000:]
            first = int(proc.args[5])
            assert out.split() == [str(first + k) for k in range(5)]
    finally:  # a writer that hung or was left running does not outlive the test
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
    _, meta = state.load(directory, 1, tree())
    assert meta["i"] in (104, 204)
    assert_loads_as(directory, meta["i"])
    state.save(directory, 1, tree(9), {"i": 9})  # the losers' debris goes
    assert len(os.listdir(directory)) == 2
