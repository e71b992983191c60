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
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from revnet._engine import sharding
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
    with sharding.in_mesh_of(x):
        flag = reduce(x)
    return sharding.scalar_here(flag)


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

    jax.debug.callback(check, index)
