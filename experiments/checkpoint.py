"""Training checkpoints that cannot run code when loaded.

A checkpoint is an ``.npz`` archive (``numpy.savez``, loaded with
``allow_pickle=False``): one array per leaf, a JSON manifest (key paths,
dtypes, shapes, metadata), and a SHA-256 checksum of every byte of the file
before it, stored as the archive's zip comment (its last bytes). Loading checks
the checksum first, then the manifest against the expected tree; anything
wrong raises :class:`CheckpointError` with a one-line reason. Files are written
atomically (temporary file, ``fsync``, ``os.replace``) and the previous one is
kept, so a corrupt latest checkpoint falls back to the previous good one.
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from typing import Any

import jax
import numpy as np

from experiments.common import atomic_write_bytes

CHECKPOINT_FORMAT = "revnet-checkpoint"
CHECKPOINT_VERSION = 1
# The file ends with the zip comment ``_TRAILER + sha256(all bytes before the
# digest).hexdigest()``; the comment is the last field of a zip archive.
_TRAILER = b"revnet-checkpoint-sha256:"
_DIGEST_LEN = 64
_MANIFEST = "manifest"


class CheckpointError(Exception):
    """A checkpoint file that must not be used; ``str(err)`` says why, briefly."""


def encode_checkpoint(tree: Any, meta: dict[str, Any]) -> bytes:
    """Serialises a pytree of arrays and JSON metadata to checkpoint bytes.

    The result is an ``.npz`` archive (``numpy.savez``, no pickle) holding one
    array per leaf (``leaf_00000``, ...) and ``manifest``, UTF-8 JSON stored as
    ``uint8``: the format and version, ``meta``, and per leaf its key path
    (``jax.tree_util.keystr``), dtype and shape. Dtypes numpy does not know
    natively (``bfloat16``) are stored as unsigned integers of the same width
    and viewed back on load; typed PRNG keys are stored as
    ``jax.random.key_data`` with their implementation's name. The archive's zip
    comment, its last bytes, is a SHA-256 digest of every byte before it.

    Args:
      tree: A pytree of arrays (JAX or numpy) and scalars.
      meta: JSON-serialisable metadata (counters, config hash, history).

    Returns:
      The file's bytes.

    Raises:
      TypeError: A leaf holds Python objects (which would need pickle).
    """
    import numpy as np

    arrays: dict[str, Any] = {}
    leaves = []
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    for i, (key_path, leaf) in enumerate(flat):
        entry: dict[str, Any] = {"path": jax.tree_util.keystr(key_path)}
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            entry["key_impl"] = str(jax.random.key_impl(leaf))
            leaf = jax.random.key_data(leaf)
        value = np.asarray(jax.device_get(leaf), order="C")  # keeps 0-d shapes
        if value.dtype.hasobject or value.dtype.kind not in "biufcV":
            raise TypeError(
                f"checkpoint leaf {entry['path']} has dtype {value.dtype}; only "
                "numeric arrays can be stored without pickle"
            )
        entry["dtype"] = value.dtype.name
        entry["shape"] = list(value.shape)
        if _stored_dtype(value.dtype) != value.dtype:
            value = value.view(_stored_dtype(value.dtype))
        entry["name"] = f"leaf_{i:05d}"
        arrays[entry["name"]] = value
        leaves.append(entry)
    manifest = {
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_VERSION,
        "meta": meta,
        "leaves": leaves,
    }
    text = json.dumps(manifest, sort_keys=True)
    arrays[_MANIFEST] = np.frombuffer(text.encode(), np.uint8)
    buf = io.BytesIO()
    np.savez(buf, allow_pickle=False, **arrays)
    placeholder = _TRAILER + b"0" * _DIGEST_LEN
    with zipfile.ZipFile(buf, "a") as archive:
        archive.comment = placeholder
    data = buf.getvalue()
    if not data.endswith(placeholder):  # the comment is a zip file's last field
        raise AssertionError("zip comment is not at the end of the archive")
    body = data[:-_DIGEST_LEN]
    return body + hashlib.sha256(body).hexdigest().encode()


def _stored_dtype(dtype: Any) -> Any:
    """The numpy-native dtype a leaf of ``dtype`` is stored as."""

    if dtype.kind in "biufc" and dtype.type.__module__ == "numpy":
        return dtype
    return np.dtype(f"u{dtype.itemsize}")  # bfloat16, float8_*: raw bits


def decode_checkpoint(data: bytes, template: Any = None) -> tuple[Any, dict[str, Any]]:
    """Verifies and parses checkpoint bytes written by ``encode_checkpoint``.

    The checksum is checked before anything is parsed, and ``numpy.load`` runs
    with ``allow_pickle=False``, so no byte sequence can execute code. Any
    problem (a flipped bit anywhere, a truncated file, a pickle, a leaf whose
    dtype or shape disagrees with the manifest or the template) raises
    ``CheckpointError``; no other exception escapes.

    Args:
      data: The file's bytes.
      template: Optional pytree with the expected structure (its leaves need
        ``shape`` and ``dtype``: arrays or ``jax.ShapeDtypeStruct``). The
        checkpoint must have exactly its key paths, shapes and dtypes.

    Returns:
      ``(tree, meta)``: the tree in ``template``'s structure with numpy leaves
      (typed PRNG keys as JAX key arrays), or without a template a flat dict
      from key path to leaf; ``meta`` as saved.

    Raises:
      CheckpointError: The bytes are not a valid checkpoint (or not this one).
    """
    data = bytes(data)
    tail = len(_TRAILER) + _DIGEST_LEN
    if len(data) < tail or data[-tail:-_DIGEST_LEN] != _TRAILER:
        raise CheckpointError("no checksum at the end: truncated or not a checkpoint")
    digest = hashlib.sha256(data[:-_DIGEST_LEN]).hexdigest().encode()
    if digest != data[-_DIGEST_LEN:]:
        raise CheckpointError("checksum mismatch")
    try:
        return _parse_checkpoint(data, template)
    except CheckpointError:
        raise
    except Exception as err:  # anything a verified file fails on: corrupt too
        detail = " ".join(str(err).split())[:100]  # one short line
        raise CheckpointError(f"unreadable: {type(err).__name__}: {detail}") from None


def _parse_checkpoint(data: bytes, template: Any) -> tuple[Any, dict[str, Any]]:
    import numpy as np

    loaded = np.load(io.BytesIO(data), allow_pickle=False)
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise CheckpointError("not an .npz archive")
    with loaded as npz:
        for info in npz.zip.infolist():
            # numpy.savez stores members uncompressed: a compressed member is
            # not ours (and could be a decompression bomb).
            if info.compress_type != zipfile.ZIP_STORED or info.file_size > len(data):
                raise CheckpointError(f"unexpected archive member {info.filename}")
        manifest = json.loads(bytes(_member(npz, _MANIFEST, np.uint8)).decode())
        if not (
            isinstance(manifest, dict)
            and manifest.get("format") == CHECKPOINT_FORMAT
            and manifest.get("version") == CHECKPOINT_VERSION
            and isinstance(manifest.get("meta"), dict)
            and isinstance(manifest.get("leaves"), list)
        ):
            raise CheckpointError("not a revnet checkpoint manifest")
        entries = manifest["leaves"]
        names = [f"leaf_{i:05d}" for i in range(len(entries))]
        if sorted(npz.files) != sorted([*names, _MANIFEST]):
            raise CheckpointError("archive members differ from the manifest")
        paths, values = [], []
        for name, entry in zip(names, entries, strict=True):
            if entry.get("name") != name:
                raise CheckpointError(f"manifest entry {name} is misnamed")
            dtype = np.dtype(entry["dtype"])
            if (
                dtype.hasobject
                or dtype.kind not in "biufcV"
                or dtype.names is not None
                or dtype.subdtype is not None
            ):
                raise CheckpointError(f"{name}: dtype {dtype} is not numeric")
            shape = tuple(int(n) for n in entry["shape"])
            value = _member(npz, name, _stored_dtype(dtype), shape)
            if _stored_dtype(dtype) != dtype:
                value = value.view(dtype)
            if "key_impl" in entry:
                value = jax.random.wrap_key_data(value, impl=str(entry["key_impl"]))
            paths.append(entry["path"])
            values.append(value)
    if template is None:
        return dict(zip(paths, values, strict=True)), manifest["meta"]
    flat, treedef = jax.tree_util.tree_flatten_with_path(template)
    want = [jax.tree_util.keystr(p) for p, _ in flat]
    if want != paths:
        raise CheckpointError(
            f"tree structure differs from this run's ({len(paths)} leaves saved, "
            f"{len(want)} expected)"
        )
    for path, value, (_, ref) in zip(paths, values, flat, strict=True):
        if tuple(value.shape) != tuple(ref.shape) or value.dtype != ref.dtype:
            raise CheckpointError(
                f"{path}: saved {value.dtype}{list(value.shape)}, this run has "
                f"{ref.dtype}{list(ref.shape)}"
            )
    return jax.tree_util.tree_unflatten(treedef, values), manifest["meta"]


def _member(npz: Any, name: str, dtype: Any, shape: tuple[int, ...] | None = None):
    """Reads array ``name`` from ``npz``, checking its dtype (and shape)."""
    value = npz[name]
    if value.dtype != dtype or value.dtype.hasobject:
        raise CheckpointError(f"{name}: stored dtype {value.dtype}, expected {dtype}")
    if shape is not None and value.shape != shape:
        raise CheckpointError(f"{name}: stored shape {value.shape}, expected {shape}")
    if shape is None and value.ndim != 1:
        raise CheckpointError(f"{name}: expected a 1-D array")
    return value


def save_checkpoint(
    path: str, tree: Any, meta: dict[str, Any], previous: str | None = None
) -> None:
    """Writes a checkpoint atomically (see ``encode_checkpoint``).

    Args:
      path: The checkpoint file.
      tree: A pytree of arrays.
      meta: JSON-serialisable metadata.
      previous: If given, an existing ``path`` is kept there (renamed, once the
        new checkpoint is on disk), so one good checkpoint survives if the
        newest is later found corrupt.
    """
    atomic_write_bytes(path, encode_checkpoint(tree, meta), previous=previous)


def load_checkpoint(path: str, template: Any = None) -> tuple[Any, dict[str, Any]]:
    """Reads and verifies a checkpoint file (see ``decode_checkpoint``).

    Raises:
      FileNotFoundError: There is no file at ``path``.
      CheckpointError: The file is unreadable, corrupt or does not match
        ``template``.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise
    except OSError as err:
        raise CheckpointError(f"unreadable: {err.strerror}") from None
    return decode_checkpoint(data, template)
