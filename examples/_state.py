"""Training state on disk: orbax-checkpoint, checked by SHA-256 before reading.

``save(directory, step, tree, meta)`` has orbax write the arrays (array data
and JSON metadata; nothing is pickled) into a folder of the writer's own,
``step_<n>.<pid>-<hex>/``, then commits them by replacing the record
``step_<n>.json`` atomically (temporary file, ``fsync``, ``os.replace``). The
record names the folder and holds ``meta``, each array's path, shape and dtype
and every file's SHA-256; its own SHA-256 covers all of that. Until the replace
the previous record and its folder stand, so a writer killed at any moment
leaves the last complete copy loadable, and two writers of one step both finish
(the last to commit wins). What no record names is removed by a later save once
its writer has exited. ``load(directory, step, template)`` checks the record
(its bytes must be the canonical JSON of its content, with its own hash), every
file's hash, and the arrays' paths, shapes and dtypes against ``template``
(orbax would cast) before orbax reads anything. Anything wrong, or a failed
save, raises :class:`StateError` with a one-line reason. A step that is being
replaced while it is read may be refused: read it again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import sys
from typing import Any

import jax
import numpy as np

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # when loaded by path
import _durable  # noqa: E402

write_json = _durable.write_json  # the examples' JSON output

FORMAT = "revnet-example-state-v2"
FIELDS = {"format", "data", "meta", "arrays", "sha256", "record_sha256"}
# A data folder; and what a writer creates (the folder, orbax's temporary
# folder, the record's temporary file), whose group 2 is the writer's pid.
_DATA = re.compile(r"step_(\d+)\.(\d+)-[0-9a-f]{8}")
_WRITTEN = re.compile(r"step_(\d+)(?:\.json)?\.(\d+)-[0-9a-f]{8}(?:\..*)?")


class StateError(Exception):
    """A saved state that must not be used, or could not be saved; says why."""


def _dumps(value: Any) -> bytes:
    """The canonical JSON of ``value``: a record's bytes are exactly these."""
    return (json.dumps(value, indent=1, sort_keys=True) + "\n").encode()


def _own_hash(record: dict) -> str:
    """SHA-256 of the record's canonical JSON without its own hash."""
    body = {k: v for k, v in record.items() if k != "record_sha256"}
    return hashlib.sha256(_dumps(body)).hexdigest()


def _arrays(tree: Any) -> list[list]:
    """``[path, shape, dtype]`` of every leaf of ``tree``."""
    found = jax.tree_util.tree_flatten_with_path(tree)[0]
    dtype = lambda x: x.dtype if hasattr(x, "dtype") else np.result_type(x)  # noqa: E731
    return [
        [jax.tree_util.keystr(p), list(np.shape(x)), str(dtype(x))] for p, x in found
    ]


def steps(directory: str) -> list[int]:
    """The saved steps with a record, oldest first."""
    if not os.path.isdir(directory):
        return []
    found = (re.fullmatch(r"step_(\d+)\.json", n) for n in os.listdir(directory))
    return sorted(int(m.group(1)) for m in found if m)


def _record(directory: str, step: int) -> dict:
    """The verified record of ``step``."""
    path = os.path.join(directory, f"step_{step:06d}.json")
    try:
        with open(path, "rb") as f:
            raw = f.read()
        record = json.loads(raw.decode("ascii"))
        if set(record) != FIELDS or record["format"] != FORMAT:
            raise ValueError("unknown format")
        if raw != _dumps(record) or record["record_sha256"] != _own_hash(record):
            raise ValueError("not canonical JSON, or fails its own SHA-256")
        data = _DATA.fullmatch(record["data"])
        if (
            not data
            or int(data.group(1)) != step
            or not isinstance(record["meta"], dict)
        ):
            raise ValueError("malformed")
        dict(record["sha256"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise StateError(f"{path} is not a state record ({err})") from None
    return record


def _sweep(directory: str) -> None:
    """Removes what writers that have exited (or this process: one save at a
    time) left that no record names; a step with an unreadable record is left."""
    named, unread = set(), set()
    for step in steps(directory):
        try:
            named.add(_record(directory, step)["data"])
        except StateError:
            unread.add(step)
    for name in set(os.listdir(directory)) - named:
        found = _WRITTEN.fullmatch(name)
        if not found or int(found.group(1)) in unread:
            continue
        if int(found.group(2)) != os.getpid():
            try:
                os.kill(int(found.group(2)), 0)  # raises if it has exited
                continue
            except ProcessLookupError:
                pass
            except OSError:
                continue
        path = os.path.join(directory, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.lexists(path):
            os.remove(path)


def save(directory: str, step: int, tree: Any, meta: dict, keep: int = 2) -> None:
    """Saves ``tree`` (arrays) and ``meta`` (JSON) as ``step``; keeps ``keep``.

    Raises:
      StateError: It could not be saved (any earlier copy of ``step`` stands).
    """
    import orbax.checkpoint as ocp

    directory = os.path.abspath(directory)
    name, failure = f"step_{step:06d}.{os.getpid()}-{secrets.token_hex(4)}", None
    try:
        os.makedirs(directory, exist_ok=True)
        data = os.path.join(directory, name)
        _durable.orbax_call("save", data, ocp.args.StandardSave(tree))
        record = {"format": FORMAT, "data": name, "meta": meta}
        record["arrays"] = _arrays(tree)
        record["sha256"] = _durable.digests(data, sync=True)
        record["record_sha256"] = _own_hash(record)
        path = os.path.join(directory, f"step_{step:06d}.json")
        _durable.write_atomically(path, _dumps(record))  # the commit
        for old in steps(directory)[:-keep] if keep > 0 else []:
            os.remove(os.path.join(directory, f"step_{old:06d}.json"))
    except Exception as err:  # raised below: no reference to orbax's frames
        failure = f"cannot save step {step} in {directory}: {_durable.one_line(err)}"
    try:
        _sweep(directory)
    except OSError:
        pass
    if failure is not None:
        raise StateError(failure)


def load(directory: str, step: int, template: Any = None) -> tuple[Any, dict]:
    """Verifies and reads step ``step``; returns ``(tree, meta)``.

    With ``template`` None, the tree comes back in orbax's own containers.

    Raises:
      StateError: The record is not a verified record, a file is missing, extra
        or fails its hash, or an array's path, shape or dtype is not
        ``template``'s.
    """
    directory = os.path.abspath(directory)
    record = _record(directory, step)
    path, want = os.path.join(directory, record["data"]), record["sha256"]
    have = _durable.digests(path) if os.path.isdir(path) else {}
    bad = sorted(n for n in want.keys() | have.keys() if want.get(n) != have.get(n))
    if bad:
        raise StateError(f"{path}: {bad[0]} is missing, extra or fails its SHA-256")
    stored, target = record["arrays"], None
    if template is not None:
        mine = _arrays(template)
        if mine != stored:
            a, b = next(
                (a, b) for a, b in zip(stored + [None], mine + [None]) if a != b
            )
            raise StateError(f"{path} does not match this run's state: {a} vs {b}")
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), template
        )
    import orbax.checkpoint as ocp

    try:
        tree = _durable.orbax_call("restore", path, ocp.args.StandardRestore(target))
    except OSError as err:  # verified, yet unreadable: not ours
        raise StateError(f"{path} is unreadable ({err})") from None
    got = [[list(x.shape), str(x.dtype)] for x in jax.tree.leaves(tree)]
    if target is not None and got != [a[1:] for a in stored]:
        raise StateError(f"{path} does not match this run's state (as read)")
    return tree, record["meta"]
