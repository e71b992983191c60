"""How a loop's backward pass gets each carry: by inversion, storage or recomputation.

The rule, applied by :func:`choose_mode` to the loop body's jaxpr (constants
and ``xs`` known, the carry unknown, every output known), for each ``mode=``
of ``revnet.while_loop`` and ``revnet.scan``:

* ``"checkpoint"``: **checkpoint**. The backward pass recomputes carries from
  snapshots (:mod:`.checkpoint`), whatever the body is.
* ``"invert"``: **invert** (:mod:`.invert`): the whole carry is rebuilt by
  inversion and the backward pass holds one carry, whatever the number of
  steps; when it cannot be, :class:`~revnet._engine.errors.Stuck` is raised.
* ``"store"`` (a loop with a bound on its steps): **invert** when the whole
  carry can be rebuilt, otherwise **store** (:mod:`.store`): the leaves
  inversion cannot rebuild are stored at every step and the others rebuilt.
  Never checkpoints.
* ``"auto"``: **invert** when the whole carry can be rebuilt; otherwise, in a
  loop with a bound on its steps (``scan``, or ``while_loop`` with
  ``max_steps``) in which inversion rebuilds, given the others, at least one
  floating-point leaf whose update reads another leaf of the carry,
  **store**; otherwise **checkpoint**. Leaves updated from themselves alone
  (a step counter ``i + 1``, a clock ``t + dt``) do not make a carry partly
  invertible.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from revnet._engine import analysis
from revnet._engine import jaxpr as jx
from revnet._engine.cotangents import is_float_aval
from revnet._engine.decisions import Exposed
from revnet._engine.errors import Stuck
from revnet._engine.loops.derived import (
    Derived,
    derived_leaves,
    inlined,
    with_derived,
)
from revnet._engine.loops.store import known_with, stored_set
from revnet._engine.plan import Plan
from revnet._engine.program import Storage, solve_exposed

AUTO, INVERT, STORE, CHECKPOINT = "auto", "invert", "store", "checkpoint"
MODES = (AUTO, INVERT, STORE, CHECKPOINT)


@dataclasses.dataclass(frozen=True)
class Mode:
    """How a loop's backward pass gets its carries.

    Attributes:
      kind: ``"invert"``, ``"store"`` or ``"checkpoint"``.
      plan: the body's plan (None when checkpointing), rebuilding the carry
        leaves that are not stored.
      stored: for each carry leaf, whether it is stored at every step.
      derived: None, or the body with its derived carry leaves tied to the
        previous step (:mod:`.derived`): then ``plan`` is that body's.
    """

    kind: str
    plan: Plan | None
    stored: tuple[bool, ...]
    derived: Derived | None = None

    def program(self, jaxpr: Any) -> Any:
        """The jaxpr ``plan`` is for, given the loop's body ``jaxpr``."""
        return jaxpr if self.derived is None else self.derived.jaxpr


def choose_mode(
    jaxpr: Any,
    known_in: Sequence[bool],
    carry: Sequence[int],
    bounded: bool,
    mode: str,
) -> Mode:
    """The backward mode of a loop whose body is ``jaxpr``.

    Args:
      jaxpr: the body; every output is known when it is run backwards.
      known_in: which inputs are known (constants, ``xs``); the carry is not.
      carry: the positions of the carry's leaves among the inputs.
      bounded: whether the number of steps has a bound known at trace time.
      mode: ``"auto"``, ``"invert"``, ``"store"`` or ``"checkpoint"``.

    Returns:
      The mode, with the body's plan and the stored leaves.

    Raises:
      Stuck: when ``mode`` is ``"invert"`` and the carry cannot be rebuilt.
      ValueError: when ``mode`` is ``"store"`` and ``bounded`` is False.

    Example::

        mode = choose_mode(jaxpr, (True, False), [1], True, "auto")
    """
    none = (False,) * len(carry)
    if mode == CHECKPOINT:
        return Mode(CHECKPOINT, None, none)
    if mode == STORE and not bounded:
        raise ValueError("a loop without a bound on its steps cannot store per step")
    known_out = (True,) * len(jaxpr.outvars)
    try:
        return Mode(INVERT, analysis.analyze(jaxpr, known_in, known_out), none)
    except Stuck as stuck:
        tied = _tied_mode(jaxpr, known_in, carry)
        if tied is not None:
            return tied
        if mode == INVERT:
            raise
        if not bounded:
            return Mode(CHECKPOINT, None, none)
        stored = stored_set(jaxpr, known_in, carry, stuck.unknown)
    if mode == AUTO and not any(
        _coupled_float(jaxpr, carry, k) for k, n in enumerate(carry) if n not in stored
    ):
        return Mode(CHECKPOINT, None, none)
    plan = analysis.analyze(jaxpr, known_with(known_in, stored), known_out)
    return Mode(STORE, plan, tuple(n in stored for n in carry))


def _tied_mode(jaxpr: Any, known_in: Sequence[bool], carry: Sequence[int]):
    """The invert mode with the body's derived carry leaves rebuilt by the
    previous step's equations (:mod:`.derived`), or None when it has none or
    is still stuck."""
    jaxpr = inlined(jaxpr)
    leaves = derived_leaves(jaxpr, carry)
    if not leaves:
        return None
    tied = with_derived(jaxpr, carry, leaves)
    extra = len(tied.jaxpr.invars) - len(jaxpr.invars)
    try:
        plan = analysis.analyze(
            tied.jaxpr, (*known_in, *(True,) * extra), (True,) * len(tied.jaxpr.outvars)
        )
    except Stuck:
        return None
    return Mode(INVERT, plan, (False,) * len(carry), tied)


def _coupled_float(jaxpr: Any, carry: Sequence[int], k: int) -> bool:
    """Whether carry leaf ``k`` is a float whose update reads another carry leaf.

    A leaf updated from itself alone (a counter ``i + 1``, a clock ``t + dt``)
    is rebuilt for free and says nothing about the rest of the carry.
    """
    if not is_float_aval(jx.aval(jaxpr.invars[carry[k]])):
        return False
    _, reads = jx.restrict(jaxpr, [k])
    return any(n in reads for n in carry if n != carry[k])


def exposed_mode(
    jaxpr: Any,
    rebuilt: Sequence[bool],
    carry: Sequence[int],
    mode: str,
    fail: Any,
    storage: Storage,
) -> tuple[Exposed, Mode]:
    """A loop body with its decisions exposed as ``storage`` says, and its
    backward mode (a loop with a bound on its steps).

    The exposure that inverts is preferred (:func:`.program.solve_exposed`).
    ``fail(stuck)`` is the user's error when neither can be planned.
    """
    known_in = tuple(n not in carry for n in range(len(jaxpr.invars)))

    def mode_of(exposed):
        return choose_mode(exposed.jaxpr, known_in, carry, True, mode)

    try:
        return solve_exposed(
            jaxpr, rebuilt, storage, mode_of, enough=lambda m: m.kind == INVERT
        )
    except Stuck as stuck:
        raise fail(stuck) from None
