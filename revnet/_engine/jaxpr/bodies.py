"""Nested jaxprs as :class:`Body` values, prepared and memoised.

A nested jaxpr (a call's body, a scan's body) is seen with its constants bound
to leading input variables, and prepared by the pass the tracing layer sets
with :func:`set_prepare` (inlining jits, merging duplicate equations), so that
the analysis reads every body as it reads a top-level jaxpr.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jax.extend import core as jex_core

from revnet._engine.jaxpr.atoms import Jaxpr


@dataclasses.dataclass(frozen=True)
class Body:
    """A nested jaxpr with its constants bound to leading input variables."""

    jaxpr: Jaxpr
    consts: tuple[Any, ...]


def nested_jaxpr(p: Any) -> tuple[Jaxpr, tuple] | None:
    """``(jaxpr, consts)`` when the param ``p`` is a (closed) jaxpr, else None."""
    if isinstance(p, jex_core.ClosedJaxpr) and not isinstance(p, Jaxpr):
        return p.jaxpr, tuple(p.consts)
    if isinstance(p, Jaxpr):
        return p, ()
    return None


def closed_consts(j: Any) -> tuple:
    """The constants of the (closed) jaxpr ``j``: values, then constvars."""
    if isinstance(j, jex_core.ClosedJaxpr) and not isinstance(j, Jaxpr):
        return tuple(j.consts) + tuple(j.jaxpr.constvars)
    return tuple(getattr(j, "constvars", ()))


_BODIES: dict = {}
_PREPARE: list[Callable[[Jaxpr], Jaxpr]] = []


def set_prepare(prepare: Callable[[Jaxpr], Jaxpr]) -> None:
    """Sets the pass that prepares every nested body (:func:`make_body`).

    The tracing layer sets its own preparation (``tracing.prepare``) when it is
    imported; the passes read jaxprs through this package, which therefore
    cannot import them.

    Args:
      prepare: maps an open jaxpr to the equivalent jaxpr the analysis reads.
    """
    _PREPARE[:] = [prepare]
    _BODIES.clear()


def as_body(j: Any) -> Body:
    """The body of a nested jaxpr, with jits inlined; memoised per jaxpr."""
    hit = _BODIES.get(id(j))
    if hit is not None and hit[0] is j:
        return hit[1]
    if len(_BODIES) > 4096:
        _BODIES.clear()
    body = make_body(j)
    _BODIES[id(j)] = (j, body)
    return body


def make_body(j: Any) -> Body:
    """The body of a nested jaxpr, prepared by the pass set with
    :func:`set_prepare` (not memoised: see :func:`as_body`).

    Raises:
      RuntimeError: if no preparation pass has been set.
      NotImplementedError: if ``j`` is an open jaxpr with unbound constvars.
    """
    if not _PREPARE:
        raise RuntimeError("no jaxpr preparation pass set: import revnet._engine")
    if isinstance(j, jex_core.ClosedJaxpr) and not isinstance(j, Jaxpr):
        inner, consts = j.jaxpr, tuple(j.consts)
    else:
        inner, consts = j, ()
    if inner.constvars:
        if not consts:  # open jaxpr with constvars: not expected, refuse.
            raise NotImplementedError("open nested jaxpr with unbound constvars")
        inner = inner.replace(
            constvars=[], invars=list(inner.constvars) + list(inner.invars)
        )
    return Body(_PREPARE[0](inner), consts)


def eval_body(body: Body, *args: Any) -> list[Any]:
    """Evaluates a nested body on its (non-const) inputs."""
    return list(
        jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(body.jaxpr, ()))(*body.consts, *args)
    )
