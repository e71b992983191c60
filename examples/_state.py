"""Training state on disk: orbax-checkpoint, checked by SHA-256 before reading.

``save(directory, step, tree, meta)`` writes the arrays with orbax's
``StandardCheckpointHandler`` (array data and JSON metadata; nothing is
pickled), synchronously, into a folder of its own, ``step_<n>.<pid>-<hex>/``.
Then it commits them by replacing the record ``step_<n>.json`` atomically
(temporary file, ``fsync``, ``os.replace``). The record names the folder and
holds ``meta``, each array's path, shape and dtype, and the SHA-256 of every
file of the folder; its own SHA-256 covers all of that. The replace is the one
commit point: until it happens the previous record and the folder it names
stay as they were, so a writer killed at any moment leaves the last complete
copy of every step loadable, and two writers of one step both finish (the last
to commit wins). Folders and temporary files that no record names are removed
by the next save, once the process that wrote them has exited; a save that
fails raises :class:`StateError` with a one-line reason.

``load(directory, step, template)`` checks the record (its exact bytes are the
canonical JSON of its content, and its own SHA-256), every file's hash, and
every array's path, shape and dtype against ``template`` (orbax would cast);
only then does orbax read the data. Anything wrong raises :class:`StateError`
with a one-line reason. A state whose step is being replaced while it is read
may be refused: read it again.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import re
import secrets
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

import jax

FORMAT = "revnet-example-state-v2"
FIELDS = {"format", "data", "meta", "arrays", "sha256", "record_sha256"}
# What a writer creates: the data folder, orbax's temporary folder for it, and
# the record's temporary file; group 2 is the writer's process id.
_DATA = re.compile(r"step_(\d+)\.(\d+)-[0-9a-f]{8}")
_WRITTEN = re.compile(r"step_(\d+)(?:\.json)?\.(\d+)-[0-9a-f]{8}(?:\..*)?")


class StateError(Exception):
    """A saved state that must not be used, or could not be saved; says why."""


def _digests(path: str, sync: bool = False) -> dict[str, str]:
    """SHA-256 of every file under ``path``, by relative path (fsynced if
    ``sync``)."""
    found = {}
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            digest = hashlib.sha256()
            with open(full, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):  # noqa: B023
                    digest.update(chunk)
                if sync:
                    os.fsync(f.fileno())
            found[os.path.relpath(full, path).replace(os.sep, "/")] = digest.hexdigest()
    return found


def _dumps(value: Any) -> bytes:
    """The canonical JSON of ``value``: a record's bytes are exactly these."""
    return (json.dumps(value, indent=1, sort_keys=True) + "\n").encode()


def _own_hash(record: dict) -> str:
    """SHA-256 of the record's canonical JSON without its own hash."""
    body = {k: v for k, v in record.items() if k != "record_sha256"}
    return hashlib.sha256(_dumps(body)).hexdigest()


def _arrays(tree: Any) -> list[list]:
    """``[path, shape, dtype]`` of every leaf of ``tree``."""
    found = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        dtype = leaf.dtype if hasattr(leaf, "dtype") else type(leaf).__name__
        found.append([jax.tree_util.keystr(path), list(jax.numpy.shape(leaf))])
        found[-1].append(str(dtype))
    return found


def _write_atomically(path: str, data: bytes) -> None:
    """Writes ``data`` to ``path``: temporary file, fsync, replace, fsync folder."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tag = f"{os.getpid()}-{secrets.token_hex(4)}"
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f"{os.path.basename(path)}.{tag}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_json(path: str, value: Any) -> None:
    """Writes ``value`` as JSON atomically (temporary file, fsync, replace)."""
    _write_atomically(path, (json.dumps(value, indent=1, sort_keys=True)).encode())


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
        if not isinstance(record, dict) or set(record) != FIELDS:
            raise ValueError("unknown fields")
        if record["format"] != FORMAT:
            raise ValueError("unknown format")
        if raw != _dumps(record):
            raise ValueError("not canonical JSON")
        if record["record_sha256"] != _own_hash(record):
            raise ValueError("fails its own SHA-256")
        data = _DATA.fullmatch(record["data"])
        if not data or int(data.group(1)) != step:
            raise ValueError("names no data folder of this step")
        if not isinstance(record["meta"], dict) or not isinstance(
            record["sha256"], dict
        ):
            raise ValueError("malformed")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise StateError(f"{path} is not a state record ({err})") from None
    return record


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists (a zombie counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _sweep(directory: str) -> None:
    """Removes what writers left that no record names, once they have exited
    (this process's own leftovers too: one save at a time per process)."""
    named, keep_steps = set(), set()
    for step in steps(directory):
        try:
            named.add(_record(directory, step)["data"])
        except StateError:
            keep_steps.add(step)  # unreadable: leave its step's folders alone
    for name in os.listdir(directory):
        found = _WRITTEN.fullmatch(name)
        if not found or name in named or int(found.group(1)) in keep_steps:
            continue
        pid = int(found.group(2))
        if pid != os.getpid() and _running(pid):
            continue
        path = os.path.join(directory, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.remove(path)
            except OSError:
                pass


def _one_line(err: BaseException) -> str:
    """``err``'s message on one line, at most 300 characters."""
    return " ".join(str(err).split())[:300] or type(err).__name__


def _orbax(method: str, path: str, args: Any) -> Any:
    """Calls orbax's synchronous checkpointer's ``method`` (save or restore).

    The synchronous checkpointer raises its errors here and leaves no thread
    behind (the asynchronous one can hang the process at exit after a failed
    save). What orbax and its threads print to stderr is held back and passed
    on only if the call succeeds: a failed save prints every thread's
    traceback, and more when its abandoned asyncio tasks are collected, so the
    failure is waited out, collected while held back, and raised as one
    :class:`StateError` that holds no reference to orbax's exception.
    """
    import orbax.checkpoint as ocp

    sys.stderr.flush()
    threads, saved, failure = set(threading.enumerate()), os.dup(2), None
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            checkpointer = ocp.Checkpointer(ocp.StandardCheckpointHandler())
            try:
                result = getattr(checkpointer, method)(path, args=args)
            finally:
                checkpointer.close()
        except Exception as err:
            failure = _one_line(err)
        try:
            if failure is not None:  # its threads and callbacks fail held back
                deadline = time.monotonic() + 5
                for thread in set(threading.enumerate()) - threads:
                    thread.join(max(0.0, deadline - time.monotonic()))
                time.sleep(0.5)
                gc.collect()  # "exception was never retrieved", held back
            sys.stderr.flush()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        if failure is None:
            held.seek(0)
            sys.stderr.buffer.write(held.read())
            sys.stderr.flush()
    if failure is not None:
        raise StateError(failure)
    return result


def save(directory: str, step: int, tree: Any, meta: dict, keep: int = 2) -> None:
    """Saves ``tree`` (arrays) and ``meta`` (JSON) as ``step``; keeps ``keep``.

    Raises:
      StateError: The state could not be saved (the previous copy of ``step``,
        if any, is still there and loadable).
    """
    import orbax.checkpoint as ocp

    directory = os.path.abspath(directory)
    name, failure = f"step_{step:06d}.{os.getpid()}-{secrets.token_hex(4)}", None
    try:
        os.makedirs(directory, exist_ok=True)
        _orbax("save", os.path.join(directory, name), ocp.args.StandardSave(tree))
        record = {"format": FORMAT, "data": name, "meta": meta}
        record["arrays"] = _arrays(tree)
        record["sha256"] = _digests(os.path.join(directory, name), sync=True)
        record["record_sha256"] = _own_hash(record)
        # The commit: until this replace, the previous record stands.
        path = os.path.join(directory, f"step_{step:06d}.json")
        _write_atomically(path, _dumps(record))
        for old in steps(directory)[:-keep] if keep > 0 else []:
            os.remove(os.path.join(directory, f"step_{old:06d}.json"))
    except Exception as err:  # not raised from here: no reference to orbax's
        failure = f"cannot save step {step} in {directory}: {_one_line(err)}"
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
        or fails its hash, or the arrays' paths, shapes or dtypes are not
        ``template``'s.
    """
    directory = os.path.abspath(directory)
    record = _record(directory, step)
    path = os.path.join(directory, record["data"])
    want = record["sha256"]
    have = _digests(path) if os.path.isdir(path) else {}
    bad = sorted(n for n in want.keys() | have.keys() if want.get(n) != have.get(n))
    if bad:
        raise StateError(f"{path}: {bad[0]} is missing, extra or fails its SHA-256")
    stored = record["arrays"]
    target = None
    if template is not None:
        mine = _arrays(template)
        for a, b in zip(stored + [None] * len(mine), mine + [None] * len(stored)):
            if a != b:
                raise StateError(
                    f"{path} does not match this run's state: stored {a}, "
                    f"this run has {b}"
                )
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), template
        )
    import orbax.checkpoint as ocp

    try:
        tree = _orbax("restore", path, ocp.args.StandardRestore(target))
    except StateError as err:  # verified, yet unreadable: not ours
        raise StateError(f"{path} is unreadable ({err})") from None
    got = [[list(x.shape), str(x.dtype)] for x in jax.tree.leaves(tree)]
    if target is not None and got != [a[1:] for a in stored]:
        raise StateError(f"{path} does not match this run's state (as read)")
    return tree, record["meta"]
