"""The training checkpoint: exact round trips, no pickle, every corruption caught.

The format (``experiments.checkpoint.save_checkpoint``) is an ``.npz`` archive with
a JSON manifest whose last bytes, the zip comment, are a SHA-256 digest of all
the bytes before them. These tests work on the save/load functions directly,
plus one subprocess run of the tiny training that starts next to corrupt
checkpoints.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pathlib
import pickle
import subprocess
import sys
import zipfile
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import checkpoint, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAILER = b"revnet-checkpoint-sha256:"


class TraceState(NamedTuple):  # the shape of an optax state
    trace: dict
    count: jax.Array


def make_tree():
    """Every kind of leaf the training saves, and a few it might."""
    rng = np.random.RandomState(0)
    params = {
        "conv": {
            "w": rng.standard_normal((3, 3, 1, 4)).astype(np.float32),
            "b": jnp.asarray(rng.standard_normal(4), jnp.float32),
        },
        "head": {"w": rng.standard_normal((4, 10)).astype(np.float32)},
    }
    return {
        "params": params,
        "state": {
            "counter": np.array(7, np.int32),  # 0-d
            "mean": jnp.asarray(rng.standard_normal(4), jnp.bfloat16),
        },
        "opt": (
            TraceState(jax.tree.map(np.zeros_like, params), jnp.array(3, jnp.int32)),
            (),
        ),
        "misc": [
            np.array([-0.0, np.nan, np.inf, 1e-45], np.float32),
            np.arange(6, dtype=np.float64).reshape(2, 3) / 3,
            np.array([True, False]),
            np.zeros((0, 5), np.uint8),
            np.array([-(2**62), 2**62 + 1], np.int64),
        ],
        "key": jax.random.key(42),
    }


META = {
    "config_hash": "abc123",
    "epoch": 3,
    "step": 66,
    "history": {"loss": [2.302585092994046, 0.1, 1 / 3, 1e-300], "step": [0, 1]},
}


def template_of(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def assert_identical(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        if jax.dtypes.issubdtype(w.dtype, jax.dtypes.prng_key):
            assert jax.random.key_impl(g) == jax.random.key_impl(w)
            g, w = jax.random.key_data(g), jax.random.key_data(w)
        assert np.asarray(g).tobytes() == np.asarray(w).tobytes()


@pytest.fixture(scope="module")
def encoded():
    return checkpoint.encode_checkpoint(make_tree(), META)


def seal(body: bytes) -> bytes:
    """Appends the digest the way the writer does (for forged files)."""
    return body + hashlib.sha256(body).hexdigest().encode()


def forged_npz(arrays: dict, allow_pickle: bool = False) -> bytes:
    """A correctly checksummed archive with arbitrary contents."""
    buf = io.BytesIO()
    np.savez(buf, allow_pickle=allow_pickle, **arrays)
    with zipfile.ZipFile(buf, "a") as archive:
        archive.comment = TRAILER + b"0" * 64
    return seal(buf.getvalue()[:-64])


class Marker:
    """Unpickling it creates a file: proof that something was unpickled."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def test_round_trip_is_exact(tmp_path, monkeypatch):
    def no_unpickling(*args, **kwargs):
        raise AssertionError("the checkpoint loader unpickled something")

    monkeypatch.setattr(pickle, "load", no_unpickling)
    monkeypatch.setattr(pickle, "loads", no_unpickling)
    tree = make_tree()
    path = str(tmp_path / "ckpt.npz")
    checkpoint.save_checkpoint(path, tree, META)
    got, meta = checkpoint.load_checkpoint(path, template_of(tree))
    assert_identical(got, tree)
    assert meta == META
    # Without a template: a flat dict from key path to leaf.
    flat, _ = checkpoint.load_checkpoint(path)
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    assert list(flat) == [jax.tree_util.keystr(p) for p, _ in paths]
    # A plain numpy reader sees an ordinary archive, no pickle needed.
    with np.load(path, allow_pickle=False) as npz:
        manifest = json.loads(bytes(npz["manifest"]).decode())
    assert manifest["meta"] == META
    assert {e["dtype"] for e in manifest["leaves"]} >= {"bfloat16", "float32", "bool"}


def test_rotation_keeps_the_previous_checkpoint(tmp_path):
    path, prev = str(tmp_path / "c.npz"), str(tmp_path / "c.prev.npz")
    tree = make_tree()
    checkpoint.save_checkpoint(path, tree, {**META, "epoch": 1}, previous=prev)
    assert not os.path.exists(prev)
    checkpoint.save_checkpoint(path, tree, {**META, "epoch": 2}, previous=prev)
    assert checkpoint.load_checkpoint(prev)[1]["epoch"] == 1
    assert checkpoint.load_checkpoint(path)[1]["epoch"] == 2
    assert sorted(os.listdir(tmp_path)) == ["c.npz", "c.prev.npz"]  # no temp files


def test_template_mismatch_is_rejected(encoded):
    tree = make_tree()
    wrong_shape = template_of(tree)
    wrong_shape["params"]["head"]["w"] = jax.ShapeDtypeStruct((4, 11), jnp.float32)
    wrong_dtype = template_of(tree)
    wrong_dtype["state"]["counter"] = jax.ShapeDtypeStruct((), jnp.float32)
    extra = {**template_of(tree), "more": jax.ShapeDtypeStruct((), jnp.float32)}
    for template in (wrong_shape, wrong_dtype, extra):
        with pytest.raises(checkpoint.CheckpointError):
            checkpoint.decode_checkpoint(encoded, template)


def test_pickle_files_are_never_unpickled(tmp_path):
    marker = tmp_path / "unpickled"
    payload = pickle.dumps({"config_hash": "x", "trees": Marker(str(marker))})
    pickle.loads(payload)  # the marker works...
    assert marker.exists()
    marker.unlink()
    path = tmp_path / "ckpt.npz"
    path.write_bytes(payload)
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.load_checkpoint(str(path))
    # A correctly checksummed archive holding an object array (a pickle in
    # an .npy member), in place of a leaf and of the manifest.
    good = make_tree()
    entries = [{"path": "[0]", "name": "leaf_00000", "dtype": "float32", "shape": [1]}]
    manifest = {"format": "revnet-checkpoint", "version": 1, "meta": META}
    manifest = np.frombuffer(
        json.dumps({**manifest, "leaves": entries}).encode(), np.uint8
    )
    evil = np.array([Marker(str(marker))], dtype=object)
    for arrays in (
        {"leaf_00000": evil, "manifest": manifest},
        {"leaf_00000": np.zeros(1, np.float32), "manifest": evil},
    ):
        data = forged_npz(arrays, allow_pickle=True)
        with pytest.raises(checkpoint.CheckpointError):
            checkpoint.decode_checkpoint(data)
        with pytest.raises(checkpoint.CheckpointError):
            checkpoint.decode_checkpoint(data, template_of(good))
    assert not marker.exists()
    # The writer refuses object leaves rather than pickling them.
    with pytest.raises(TypeError):
        checkpoint.encode_checkpoint({"x": evil}, META)
    assert not marker.exists()


def test_every_byte_flip_is_detected(encoded):
    tree = make_tree()
    template = template_of(tree)
    assert len(encoded) < 16_000  # flipping every byte stays fast
    for i in range(len(encoded)):
        data = bytearray(encoded)
        data[i] ^= 0xFF
        with pytest.raises(checkpoint.CheckpointError):
            checkpoint.decode_checkpoint(bytes(data), template)


def test_single_bit_flips_are_detected_incl_parameter_data(encoded):
    tree = make_tree()
    template = template_of(tree)
    weights = tree["params"]["conv"]["w"].tobytes()
    start = encoded.find(weights)
    assert start > 0  # the parameter bytes are stored as they are
    rng = np.random.RandomState(1)
    positions = set(range(start, start + len(weights)))  # every parameter byte
    positions |= set(rng.randint(0, len(encoded), 200).tolist())
    positions |= {0, len(encoded) - 1, len(encoded) - 65, len(encoded) - 90}
    for i in sorted(positions):
        for bit in range(8):
            data = bytearray(encoded)
            data[i] ^= 1 << bit
            with pytest.raises(checkpoint.CheckpointError, match="checksum|truncated"):
                checkpoint.decode_checkpoint(bytes(data), template)


def test_forged_corruption_never_raises_anything_else(encoded):
    """Flips with a RECOMPUTED checksum reach the parser: still only
    CheckpointError (or a valid tree), never another exception."""
    template = template_of(make_tree())
    body = encoded[:-64]
    # Every byte of the zip directory at the end, every 4th byte before it.
    directory = encoded.find(b"PK\x01\x02")
    assert directory > 0
    positions = [*range(0, directory, 4), *range(directory, len(body))]
    outcomes = {"rejected": 0, "accepted": 0}
    for i in positions:
        for flip in (0xFF, 0x01):
            data = bytearray(body)
            data[i] ^= flip
            try:
                tree, _ = checkpoint.decode_checkpoint(seal(bytes(data)), template)
            except checkpoint.CheckpointError:
                outcomes["rejected"] += 1
                continue
            outcomes["accepted"] += 1
            assert jax.tree.structure(tree) == jax.tree.structure(template)
    assert outcomes["rejected"] > 0 and outcomes["accepted"] > 0, outcomes


def test_truncation_is_detected(encoded, tmp_path):
    template = template_of(make_tree())
    for n in range(len(encoded)):
        with pytest.raises(checkpoint.CheckpointError):
            checkpoint.decode_checkpoint(encoded[:n], template)
    path = tmp_path / "ckpt.npz"
    path.write_bytes(encoded + b"\0")  # appended bytes, too
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.load_checkpoint(str(path), template)


def write(out, name, data: bytes) -> None:
    (out / name).write_bytes(data)


def resume(out, capsys, config_hash="abc123"):
    template = template_of({"trees": make_tree()})
    tree, meta, latest_ok = train.resume_point(str(out), lambda: template, config_hash)
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert captured.out == "" and len(lines) <= 1, lines
    return tree, meta, latest_ok, (lines or [""])[0]


def encode(epoch: int) -> bytes:
    return checkpoint.encode_checkpoint(
        {"trees": make_tree()}, {**META, "epoch": epoch}
    )


def test_corrupt_latest_resumes_from_previous(tmp_path, capsys):
    good = encode(4)
    bad = bytearray(encode(5))
    bad[len(bad) // 2] ^= 0x10
    write(tmp_path, train.CHECKPOINT, bytes(bad))
    write(tmp_path, train.PREVIOUS_CHECKPOINT, good)
    tree, meta, latest_ok, line = resume(tmp_path, capsys)
    assert meta["epoch"] == 4 and not latest_ok
    assert_identical(tree["trees"], make_tree())
    assert "is corrupt (checksum mismatch)" in line and train.CHECKPOINT in line
    assert "resuming from the previous checkpoint" in line and "epoch 4" in line


def test_good_latest_is_used_silently(tmp_path, capsys):
    write(tmp_path, train.CHECKPOINT, encode(5))
    write(tmp_path, train.PREVIOUS_CHECKPOINT, b"garbage")
    _, meta, latest_ok, line = resume(tmp_path, capsys)
    assert meta["epoch"] == 5 and latest_ok and line == ""
    for name in os.listdir(tmp_path):
        os.unlink(tmp_path / name)
    _, meta, _, line = resume(tmp_path, capsys)  # nothing there: a first run
    assert meta is None and line == ""


def test_missing_latest_resumes_from_previous(tmp_path, capsys):
    # kill -9 between rotating the latest away and renaming the new one in.
    write(tmp_path, train.PREVIOUS_CHECKPOINT, encode(2))
    _, meta, latest_ok, line = resume(tmp_path, capsys)
    assert meta["epoch"] == 2 and not latest_ok
    assert "is missing" in line and "resuming from the previous" in line


@pytest.mark.parametrize(
    "latest, previous",
    [(b"truncated", b""), (b"x", None), (None, b"PK\x03\x04")],
)
def test_no_usable_checkpoint_starts_from_scratch(tmp_path, capsys, latest, previous):
    if latest is not None:
        write(tmp_path, train.CHECKPOINT, latest)
    if previous is not None:
        write(tmp_path, train.PREVIOUS_CHECKPOINT, previous)
    tree, meta, latest_ok, line = resume(tmp_path, capsys)
    assert tree is None and meta is None and not latest_ok
    assert line.startswith("train: checkpoint ") and "corrupt" in line
    assert line.endswith("starting from scratch")


def test_other_configuration_is_not_resumed(tmp_path, capsys):
    write(tmp_path, train.CHECKPOINT, encode(5))
    tree, _, _, line = resume(tmp_path, capsys, config_hash="other")
    assert tree is None
    assert "different configuration" in line and "starting from scratch" in line


def test_training_starts_over_next_to_corrupt_checkpoints(tmp_path):
    """One tiny training run: a pickle in place of the latest checkpoint and a
    truncated previous one. The run reports both in one line, unpickles
    nothing, trains from scratch and leaves a checkpoint that loads."""
    marker = tmp_path / "unpickled"
    out = tmp_path / "out"
    out.mkdir()
    write(out, train.CHECKPOINT, pickle.dumps({"epoch": 1, "x": Marker(str(marker))}))
    write(out, train.PREVIOUS_CHECKPOINT, encode(1)[:1000])
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.train", "--tiny", "--out", str(out)]
        + ["--epochs", "1", "--no-control"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not marker.exists()
    lines = [line for line in proc.stderr.splitlines() if "train: checkpoint" in line]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "corrupt" in lines[0] and lines[0].endswith("starting from scratch")
    with open(out / "train.json") as f:
        assert json.load(f)["resumed_from_epoch"] == 0
    _, meta = checkpoint.load_checkpoint(str(out / train.CHECKPOINT))
    assert meta["epoch"] == 1 and meta["step"] == len(meta["history"]["step"])
