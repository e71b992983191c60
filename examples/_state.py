"""Training state on disk: orbax-checkpoint, checked by SHA-256 before reading.

``save(directory, step, tree, meta)`` writes ``step_<n>/`` with orbax's
``StandardCheckpointer`` (array data and JSON metadata; nothing is pickled),
then, atomically (temporary file, ``fsync``, ``os.replace``), ``step_<n>.json``:
``meta`` and the SHA-256 of every file of ``step_<n>/``. A step without its
record is unfinished and ignored. ``load(directory, step, template)`` checks
the record and every file's hash first and only then lets orbax read the data,
into ``template``'s structure, shapes and dtypes. Anything wrong raises
:class:`StateError` with a one-line reason.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from typing import Any

import jax

FORMAT = "revnet-example-state-v1"


class StateError(Exception):
    """A saved state that must not be used; ``str(err)`` says why."""


def _digests(path: str) -> dict[str, str]:
    """SHA-256 of every file under ``path``, by relative path."""
    found = {}
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            digest = hashlib.sha256()
            with open(full, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):  # noqa: B023
                    digest.update(chunk)
            found[os.path.relpath(full, path)] = digest.hexdigest()
    return found


def write_json(path: str, value: Any) -> None:
    """Writes ``value`` as JSON atomically (temporary file, fsync, replace)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(value, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def steps(directory: str) -> list[int]:
    """The saved steps with a record, oldest first."""
    if not os.path.isdir(directory):
        return []
    found = (re.fullmatch(r"step_(\d+)\.json", n) for n in os.listdir(directory))
    return sorted(int(m.group(1)) for m in found if m)


def save(directory: str, step: int, tree: Any, meta: dict, keep: int = 2) -> None:
    """Saves ``tree`` (arrays) and ``meta`` (JSON) as ``step``; keeps ``keep``."""
    import orbax.checkpoint as ocp

    path = os.path.join(os.path.abspath(directory), f"step_{step:06d}")
    shutil.rmtree(path, ignore_errors=True)  # an unfinished earlier attempt
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, tree)
        checkpointer.wait_until_finished()
    record = {"format": FORMAT, "meta": meta, "sha256": _digests(path)}
    write_json(path + ".json", record)
    for old in steps(directory)[:-keep]:
        old_path = os.path.join(directory, f"step_{old:06d}")
        os.remove(old_path + ".json")
        shutil.rmtree(old_path, ignore_errors=True)


def load(directory: str, step: int, template: Any = None) -> tuple[Any, dict]:
    """Verifies and reads step ``step``; returns ``(tree, meta)``.

    With ``template`` None, the tree comes back in orbax's own containers.

    Raises:
      StateError: The record does not parse, a file is missing, extra or fails
        its hash, or the data does not match ``template``.
    """
    path = os.path.join(os.path.abspath(directory), f"step_{step:06d}")
    try:
        with open(path + ".json", "rb") as f:
            record = json.loads(f.read().decode())
        if record["format"] != FORMAT or not isinstance(record["meta"], dict):
            raise ValueError("unknown format")
        want = dict(record["sha256"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise StateError(f"{path}.json is not a state record ({err})") from None
    have = _digests(path) if os.path.isdir(path) else {}
    bad = sorted(n for n in want.keys() | have.keys() if want.get(n) != have.get(n))
    if bad:
        raise StateError(f"{path}: {bad[0]} is missing, extra or fails its SHA-256")
    import orbax.checkpoint as ocp

    target = None
    if template is not None:
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), template
        )
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            tree = checkpointer.restore(path, target)
    except Exception as err:  # verified, yet unreadable: not ours
        raise StateError(f"{path} is unreadable ({type(err).__name__})") from None
    shapes = lambda t: [(x.shape, x.dtype) for x in jax.tree.leaves(t)]  # noqa: E731
    if target is not None and (
        jax.tree.structure(tree) != jax.tree.structure(target)
        or shapes(tree) != shapes(target)
    ):
        raise StateError(f"{path} does not match this run's state")
    return tree, record["meta"]
