"""Run-time checks of reconstructions: degenerate values that no trace can see.

Some programs are invertible for almost all values but not for the ones they
meet at run time: a closed-over weight that is zero, a singular matrix, a
``tanh`` saturated to exactly 1 in float32, a dropout mask multiplied into the
stream. Their inverse gives ``inf``/``nan`` where the outputs are finite, and
the gradient is then ``nan`` where plain backprop is finite.

With checks on, every inverse step records whether it produced a non-finite
value from finite ones. Inside loops the records are reduced into one integer
carried by the loop (the index of the first failing step's message, or -1);
the backward pass ends with ONE ``jax.debug.callback`` that raises
:class:`~revnet.NotInvertibleError` naming the equation and the user's line.
The cost is a few elementwise reductions per inverted equation and one host
callback per backward pass (and a host synchronisation point there), so the
checks are off by default; tests turn them on. Turn them on with
``REVNET_RUNTIME_CHECKS=1`` or :func:`set_runtime_checks`; the setting is read
when a function is traced.

Under a mesh, that callback and the drift monitor's (:func:`host_callback`) run
on every device, not on one: an exception raised by a callback stops only the
device that ran it, and its peers then wait for it at the next collective, for
ever (a later step in one process, the other processes of a multi-process
run). Run on every device, the callback raises on every device, so every
device stops at the same point, and every process raises.
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from revnet._engine import sharded_types
from revnet._engine.cotangents import is_float
from revnet._engine.errors import NotInvertibleError

_ENV = "REVNET_RUNTIME_CHECKS"
_override: list[bool] = []
# One list of records per active scope; a record is (index, messages): an int32
# scalar, -1 when fine, else the index of the failing message.
_SCOPES: list[list[tuple[Any, list[str]]]] = []


def set_runtime_checks(enabled: bool | None) -> None:
    """Turns run-time reconstruction checks on or off (None: from the env var).

    Args:
      enabled: True or False, or None to follow ``REVNET_RUNTIME_CHECKS``.
    """
    _override.clear()
    if enabled is not None:
        _override.append(bool(enabled))


def enabled() -> bool:
    if _override:
        return _override[0]
    return os.environ.get(_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def record(rebuilt: Sequence[Any], given: Sequence[Any], message: str) -> None:
    """Records a failure when ``rebuilt`` is not finite but ``given`` is."""
    if not _SCOPES:
        return
    rebuilt = [x for x in rebuilt if x is not None and is_float(x)]
    given = [x for x in given if x is not None and is_float(x)]
    if not rebuilt:
        return
    bad = jnp.any(
        jnp.stack([_each(x, lambda v: jnp.any(~jnp.isfinite(v))) for x in rebuilt])
    )
    if given:
        ok_in = jnp.all(
            jnp.stack([_each(x, lambda v: jnp.all(jnp.isfinite(v))) for x in given])
        )
        bad = jnp.logical_and(bad, ok_in)
    _SCOPES[-1].append((jnp.where(bad, 0, -1).astype(jnp.int32), [message]))


def _each(x: Any, reduce: Any) -> Any:
    """``reduce(x)`` to a scalar, in ``x``'s view of the mesh (``auto_axes``
    bodies have their own), as a scalar of the current one."""
    with sharded_types.in_mesh_of(x):
        flag = reduce(x)
    return sharded_types.scalar_here(flag)


def record_index(index: Any, messages: list[str]) -> None:
    """Records a reduced failure index over ``messages`` (from a loop)."""
    if _SCOPES and messages:
        _SCOPES[-1].append((index, messages))


class Scope:
    """The records of one traced region, reduced to ``(index, messages)``."""

    def __init__(self) -> None:
        self.records: list[tuple[Any, list[str]]] = []

    def reduce(self) -> tuple[Any, list[str]]:
        messages: list[str] = []
        index = jnp.int32(-1)
        parts = []
        for idx, msgs in self.records:
            parts.append((idx, len(messages)))
            messages.extend(msgs)
        for idx, offset in reversed(parts):
            index = jnp.where(idx >= 0, idx + offset, index)
        return index, messages


@contextlib.contextmanager
def scope() -> Iterator[Scope | None]:
    """Collects the records made inside; yields None when checks are off."""
    if not enabled():
        yield None
        return
    s = Scope()
    _SCOPES.append(s.records)
    try:
        yield s
    finally:
        _SCOPES.pop()


def merge(previous: Any, s: Scope | None, messages: list[str]) -> Any:
    """A loop carry's failure index after one more step (first failure wins).

    ``messages`` is the loop's message list; it is rebuilt on every trace.
    """
    if s is None:
        return previous
    index, msgs = s.reduce()
    messages.clear()
    messages.extend(msgs)
    return jnp.where(previous >= 0, previous, index)


def raise_if_failed(s: Scope | None) -> None:
    """Emits the one callback that raises when a record failed."""
    if s is None or not s.records:
        return
    index, messages = s.reduce()
    messages = tuple(messages)

    def check(i):
        i = int(i)
        if i >= 0:
            raise NotInvertibleError(messages[i])

    host_callback(check, index)


class _Copies:
    """Lets one of each ``copies`` calls with the same arguments run ``fn``.

    The others get its outcome: nothing, or a copy of the exception it raised.
    """

    def __init__(self, fn: Callable[..., None], copies: int):
        self.fn, self.copies = fn, copies
        self.lock = threading.Lock()
        self.pending: dict[tuple, list] = {}  # arguments -> [calls left, error]

    def __call__(self, *args: Any) -> None:
        key = tuple((a.dtype.str, a.shape, a.tobytes()) for a in map(np.asarray, args))
        with self.lock:
            entry = self.pending.get(key)
            if entry is None:
                try:
                    self.fn(*args)
                    error = None
                except Exception as e:  # noqa: BLE001 - re-raised below
                    error = e
                entry = [self.copies, error]
                self.pending[key] = entry
            entry[0] -= 1
            if entry[0] <= 0:
                del self.pending[key]
        if entry[1] is not None:
            raise copy.copy(entry[1])  # a fresh traceback per copy


def _copies_per_process(mesh: Any) -> int | None:
    """How many of ``mesh``'s devices each process has, or None if unknown."""
    if jax.process_count() == 1:
        return mesh.size
    if mesh.size == jax.device_count():
        return jax.local_device_count()
    return None


def host_callback(fn: Callable[..., None], *args: Any) -> None:
    """``jax.debug.callback(fn, *args)``, run once per process, raising on all.

    Under a global mesh (``jax.set_mesh``, Auto or Explicit axes) JAX runs a
    debug callback once, on the mesh's first device: only one process sees it,
    and if it raises only that device stops while the others wait for it at
    their next collective. Here it runs on every device of the mesh (in a
    fully manual ``shard_map``, with the replicated ``args``); on each
    process one copy calls ``fn`` (records a reading, warns) and every copy
    raises what ``fn`` raised, so every device stops at the same point.

    Outside a mesh, inside ``shard_map`` (where JAX already runs callbacks per
    device), or where the mesh is not made of every process's devices, it is
    a plain ``jax.debug.callback``.
    """
    mesh = jax.sharding.get_abstract_mesh()
    copies = None
    if not mesh.empty and AxisType.Manual not in mesh.axis_types:
        copies = _copies_per_process(mesh)
    if copies is None or mesh.size == 1:
        jax.debug.callback(fn, *args)
        return
    once = _Copies(fn, copies)

    def body(*a):
        jax.debug.callback(once, *a)
        return ()

    jax.shard_map(
        body, mesh=mesh, in_specs=(P(),) * len(args), out_specs=(), check_vma=False
    )(*args)
