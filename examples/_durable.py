"""Files written whole or not at all, their SHA-256, and orbax called quietly.

Helpers of ``_state.py`` (and the examples' JSON output): :func:`write_json`
writes through a synced temporary file and ``os.replace``; :func:`orbax_call`
runs orbax's synchronous checkpointer so that a failure is one exception with
a one-line message, no thread left behind and nothing printed.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import secrets
import sys
import tempfile
import threading
import time
from typing import Any


def digests(path: str, sync: bool = False) -> dict[str, str]:
    """SHA-256 of every file under ``path`` by relative path; fsyncs if ``sync``."""
    found = {}
    for root, _, names in os.walk(path):
        for name in names:
            digest = hashlib.sha256()
            with open(os.path.join(root, name), "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):  # noqa: B023
                    digest.update(chunk)
                if sync:
                    os.fsync(f.fileno())
            relative = os.path.relpath(os.path.join(root, name), path)
            found[relative.replace(os.sep, "/")] = digest.hexdigest()
    return found


def write_json(path: str, value: Any) -> None:
    """Writes ``value`` as JSON atomically (see :func:`write_atomically`)."""
    write_atomically(path, json.dumps(value, indent=1, sort_keys=True).encode())


def write_atomically(path: str, data: bytes) -> None:
    """Writes ``data`` to ``path`` whole or not at all: a temporary file in the
    same folder, fsync, ``os.replace``, fsync of the folder."""
    folder, name = os.path.split(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tag = f"{name}.{os.getpid()}-{secrets.token_hex(4)}."  # pid: see _state._sweep
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=tag)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fd = os.open(folder, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def one_line(err: BaseException) -> str:
    """``err``'s message on one line: its start and its end (often the
    reason) when it is longer than 500 characters."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 500 else f"{text[:200]} ... {text[-300:]}"


def orbax_call(method: str, path: str, args: Any) -> Any:
    """Calls ``method`` (save, restore) of orbax's synchronous checkpointer.

    It raises its errors here and leaves no thread behind (the asynchronous
    one can hang the process at exit after a failed save). A failed save also
    prints every thread's traceback, and more when its abandoned tasks are
    collected: stderr is held back, the failure waited out and collected, and
    raised as one ``OSError`` with no reference to orbax's exception;
    on success what was held back is passed on.
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
            failure = one_line(err)
        try:
            if failure is not None:
                deadline = time.monotonic() + 5
                for thread in set(threading.enumerate()) - threads:
                    thread.join(max(0.0, deadline - time.monotonic()))
                time.sleep(0.5)  # callbacks from orbax's C++ threads
                gc.collect()  # "exception was never retrieved"
            sys.stderr.flush()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        if failure is None:
            held.seek(0)
            sys.stderr.buffer.write(held.read())
            sys.stderr.flush()
    if failure is not None:
        raise OSError(failure)
    return result
