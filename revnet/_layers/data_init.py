"""Data-dependent initialisation (ActNorm's) in the NNX and Equinox doors.

Haiku initialises from data at ``init``: the sequence runs its layers one
after another there, each from its own input. NNX and Equinox build their
modules before any data is seen, so their sequences have an ``initialize(x)``
pass: it runs the layers one after another on ``x`` inside :func:`collecting`,
where each ActNorm sets its parameters from the input it sees (NNX), or
reports them (Equinox, whose modules are immutable), before it applies them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

_FOUND: ContextVar[list | None] = ContextVar("revnet_data_init", default=None)


@contextmanager
def collecting() -> Iterator[list]:
    """Turns data-dependent initialisation on; yields the list that layers
    report ``(layer, parameters)`` to."""
    found: list[Any] = []
    token = _FOUND.set(found)
    try:
        yield found
    finally:
        _FOUND.reset(token)


def active() -> list | None:
    """The list of :func:`collecting`, or None outside it."""
    return _FOUND.get()
