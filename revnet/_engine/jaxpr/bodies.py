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


# JAX 0.10 wraps a jaxpr and its constants' values in a ClosedJaxpr; from JAX
# 0.11 on, ClosedJaxpr is Jaxpr, which holds the values of its leading
# constvars itself (and a constvar without a value is a plain input).
_CLOSED_IS_JAXPR = jex_core.ClosedJaxpr is Jaxpr


def split_closed(j: Any) -> tuple[Jaxpr, tuple]:
    """``(jaxpr, consts)`` of a closed jaxpr (or ``(j, ())`` of an open one):
    ``consts`` are the values of ``jaxpr.constvars``."""
    if _CLOSED_IS_JAXPR:
        return j, tuple(j.consts)
    if isinstance(j, jex_core.ClosedJaxpr):
        return j.jaxpr, tuple(j.consts)
    return j, ()


def closed(j: Jaxpr, n: int, consts: Any) -> Any:
    """The closed jaxpr whose constvars are ``j``'s first ``n`` inputs, with
    the values ``consts`` (``n`` of them)."""
    open_ = j.replace(constvars=list(j.invars[:n]), invars=list(j.invars[n:]))
    return jex_core.ClosedJaxpr(open_, list(consts))


def nested_jaxpr(p: Any) -> tuple[Jaxpr, tuple] | None:
    """``(jaxpr, consts)`` when the param ``p`` is a (closed) jaxpr, else None."""
    if isinstance(p, (jex_core.ClosedJaxpr, Jaxpr)):
        return split_closed(p)
    return None


def closed_consts(j: Any) -> tuple:
    """The constants of the (closed) jaxpr ``j``: their values, or the
    constvars of an open jaxpr that has no values for them."""
    if not isinstance(j, (jex_core.ClosedJaxpr, Jaxpr)):
        return ()
    jaxpr, consts = split_closed(j)
    return consts or tuple(jaxpr.constvars)


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
    inner, consts = split_closed(j)
    if inner.constvars:
        if not consts:  # open jaxpr with constvars: not expected, refuse.
            raise NotImplementedError("open nested jaxpr with unbound constvars")
        inner = inner.replace(
            constvars=[], invars=list(inner.constvars) + list(inner.invars)
        )
    return Body(_PREPARE[0](inner), consts)


def eval_body(body: Body, *args: Any) -> list[Any]:
    """Evaluates a nested body on its (non-const) inputs."""
    return list(jex_core.jaxpr_as_fun(closed(body.jaxpr, 0, ()))(*body.consts, *args))
