"""Testing hooks: what revnet's loops chose, and what their backward passes ran.

Two module-level lists of callbacks, empty unless a test fills them. The
engine reads each in one place, and only calls what it finds there; an empty
list changes nothing, not even the compiled program. The lists are mutated in
place, never rebound: the context managers below add a callback and take it
out again, and are how tests use them.

* :data:`MODE_HOOKS`: each callback is given the backward mode
  (:class:`~.choose.Mode`) of every loop whose custom VJP is built
  (:func:`.vjp.while_function`, :func:`.vjp.scan_function`), when the loop
  is traced: one call per loop (a ``scan`` under ``jax.vmap`` is traced
  again for the batched body, and so reports again).
* :data:`STEP_HOOKS`: each callback is given, through ``jax.debug.callback``
  at run time, the remaining-step counter of every iteration of a while
  loop's backward pass (the walk back of :mod:`.invert`, in the invert and
  store modes; under ``jax.vmap``, one counter per element). The list is
  read when the backward pass is traced: only backward passes traced while a
  callback is in the list call it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax

MODE_HOOKS: list[Callable[[Any], None]] = []
STEP_HOOKS: list[Callable[[Any], None]] = []


@contextlib.contextmanager
def _added(hooks: list, hook: Callable[[Any], None]) -> Iterator[None]:
    hooks.append(hook)
    try:
        yield
    finally:
        hooks.remove(hook)


@contextlib.contextmanager
def modes_chosen() -> Iterator[list[Any]]:
    """Records the backward mode of every loop traced inside the block.

    Example::

        with modes_chosen() as seen:
            revnet.scan(f, init, xs)
        assert [m.kind for m in seen] == ["invert"]
    """
    seen: list[Any] = []
    with _added(MODE_HOOKS, seen.append):
        yield seen


@contextlib.contextmanager
def backward_steps() -> Iterator[list[Any]]:
    """Records the remaining-step counter of every while-loop backward
    iteration, in the backward passes traced inside the block.

    The counters arrive when the program runs (run it inside the block); on
    leaving the block, the pending callbacks are waited for.

    Example::

        with backward_steps() as seen:
            jax.block_until_ready(jax.jit(jax.grad(loss))(x))
        assert [int(m) for m in seen] == [3, 2, 1]
    """
    seen: list[Any] = []
    with _added(STEP_HOOKS, seen.append):
        try:
            yield seen
        finally:
            jax.effects_barrier()
