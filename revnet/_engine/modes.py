"""How a loop's backward pass gets each carry: by inversion, storage or recomputation.

The rule, applied by :func:`choose` to the loop body's jaxpr (constants and
``xs`` known, the carry unknown, every output known):

1. ``invert=False``: **checkpoint**. The backward pass recomputes carries from
   snapshots (:mod:`.revolve`), whatever the body is.
2. The whole carry can be rebuilt by inversion: **invert**. The backward pass
   holds one carry, whatever the number of steps.
3. ``invert=True`` and (2) does not hold: :class:`~.errors.Stuck` is raised.
4. The loop has a bound on its steps (``scan``, or ``while_loop`` with
   ``max_steps``) and inversion rebuilds, given the others, at least one
   floating-point leaf whose update reads another leaf of the carry:
   **store**. The leaves it cannot rebuild are stored at every step
   (``bound`` copies of those leaves only) and the others are rebuilt. Leaves
   updated from themselves alone (a step counter ``i + 1``, a clock ``t +
   dt``) do not make a carry partly invertible.
5. Otherwise: **checkpoint**.

The stored set of (4) is found by the analysis: every leaf left unknown is
stored, then each stored leaf is given back to the inversion, largest first,
and stays rebuilt if the body can still be solved without it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from revnet._engine import analysis
from revnet._engine import jaxpr as jx
from revnet._engine.cotangents import is_float_aval
from revnet._engine.errors import Stuck
from revnet._engine.plan import Plan
from revnet._engine.scan import restrict

INVERT, STORE, CHECKPOINT = "invert", "store", "checkpoint"


@dataclasses.dataclass(frozen=True)
class Mode:
    """How a loop's backward pass gets its carries.

    Attributes:
      kind: ``"invert"``, ``"store"`` or ``"checkpoint"``.
      plan: the body's plan (None when checkpointing), rebuilding the carry
        leaves that are not stored.
      stored: for each carry leaf, whether it is stored at every step.
    """

    kind: str
    plan: Plan | None
    stored: tuple[bool, ...]


def choose(
    jaxpr: Any,
    known_in: Sequence[bool],
    carry: Sequence[int],
    bounded: bool,
    invert: bool | None,
) -> Mode:
    """The backward mode of a loop whose body is ``jaxpr``.

    Args:
      jaxpr: the body; every output is known when it is run backwards.
      known_in: which inputs are known (constants, ``xs``); the carry is not.
      carry: the positions of the carry's leaves among the inputs.
      bounded: whether the number of steps has a bound known at trace time.
      invert: None (automatic), True (inversion required) or False (never).

    Raises:
      Stuck: when ``invert`` is True and the carry cannot be rebuilt.
    """
    none = (False,) * len(carry)
    if invert is False:
        return Mode(CHECKPOINT, None, none)
    known_out = (True,) * len(jaxpr.outvars)
    try:
        return Mode(INVERT, analysis.analyze(jaxpr, known_in, known_out), none)
    except Stuck as stuck:
        if invert:
            raise
        if not bounded:
            return Mode(CHECKPOINT, None, none)
        unknown = set(stuck.unknown)
    stored = {n for n in carry if n in unknown}
    sizes = {n: _nbytes(jx.aval(jaxpr.invars[n])) for n in stored}
    for n in sorted(stored, key=lambda n: (-sizes[n], n)):
        trial = stored - {n}
        try:
            analysis.analyze(jaxpr, _with(known_in, trial), known_out)
        except Stuck:
            continue
        stored = trial
    if not any(
        _coupled_float(jaxpr, carry, k) for k, n in enumerate(carry) if n not in stored
    ):
        return Mode(CHECKPOINT, None, none)
    plan = analysis.analyze(jaxpr, _with(known_in, stored), known_out)
    return Mode(STORE, plan, tuple(n in stored for n in carry))


def _coupled_float(jaxpr: Any, carry: Sequence[int], k: int) -> bool:
    """Whether carry leaf ``k`` is a float whose update reads another carry leaf.

    A leaf updated from itself alone (a counter ``i + 1``, a clock ``t + dt``)
    is rebuilt for free and says nothing about the rest of the carry.
    """
    if not is_float_aval(jx.aval(jaxpr.invars[carry[k]])):
        return False
    _, reads = restrict(jaxpr, [k])
    return any(n in reads for n in carry if n != carry[k])


def _with(known_in: Sequence[bool], extra: set[int]) -> tuple[bool, ...]:
    return tuple(k or n in extra for n, k in enumerate(known_in))


def _nbytes(a: Any) -> int:
    return int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize
