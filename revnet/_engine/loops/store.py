"""The store mode: carry leaves kept at every step, the others rebuilt.

A loop with a bound on its steps whose carry is invertible only in part
stores, at every step, the carry leaves inversion cannot rebuild (``bound``
copies of those leaves only) and rebuilds the others by the body's plan,
walking back as the invert mode does (:mod:`.invert`). The forward loops
write the stored leaves (:func:`stored_leaves`), and the backward pass puts
each step's carry together again (:func:`merge`).

The stored set is found by the analysis (:func:`stored_set`): every leaf
left unknown is stored, then each stored leaf is given back to the
inversion, largest first, and stays rebuilt if the body can still be solved
without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from revnet._engine import analysis
from revnet._engine import jaxpr as jx
from revnet._engine.errors import Stuck


def stored_leaves(carry: Sequence[Any], stored: Sequence[bool]) -> list:
    """The carry leaves that are stored at every step."""
    return [x for x, s in zip(carry, stored) if s]


def merge(rebuilt: Sequence[Any], kept: Sequence[Any], mask: Sequence[bool]) -> list:
    """A carry from its rebuilt leaves and its kept ones (``mask``: which are kept)."""
    rebuilt, kept = iter(rebuilt), iter(kept)
    return [next(kept) if m else next(rebuilt) for m in mask]


def stored_set(
    jaxpr: Any, known_in: Sequence[bool], carry: Sequence[int], unknown: Sequence[int]
) -> set[int]:
    """The carry inputs of ``jaxpr`` to store, so that the others are rebuilt.

    Args:
      jaxpr: the loop's body; every output is known when it is run backwards.
      known_in: which inputs are known (constants, ``xs``); the carry is not.
      carry: the positions of the carry's leaves among the inputs.
      unknown: the inputs a failed inversion of the whole carry left unknown.

    Returns:
      The positions (among the inputs) of the carry leaves to store: a set
      from which no leaf can be given back to the inversion.
    """
    known_out = (True,) * len(jaxpr.outvars)
    unknown = set(unknown)
    stored = {n for n in carry if n in unknown}
    sizes = {n: _nbytes(jx.aval(jaxpr.invars[n])) for n in stored}
    for n in sorted(stored, key=lambda n: (-sizes[n], n)):
        trial = stored - {n}
        try:
            analysis.analyze(jaxpr, known_with(known_in, trial), known_out)
        except Stuck:
            continue
        stored = trial
    return stored


def lost_leaves(jaxpr: Any, carry: Sequence[int], unknown: Sequence[int]) -> list[int]:
    """The carry leaves (indices into ``carry``) whose old value no output of
    ``jaxpr`` determines, when the others are rebuilt once those are given: a
    leaf the step overwrites, such as a force recomputed from new positions.
    Empty when giving leaves back does not make the rest invertible."""
    known_in = tuple(n not in carry for n in range(len(jaxpr.invars)))
    stored = stored_set(jaxpr, known_in, carry, unknown)
    if len(stored) == len(carry):
        return []
    try:
        analysis.analyze(
            jaxpr, known_with(known_in, stored), (True,) * len(jaxpr.outvars)
        )
    except Stuck:
        return []
    return [k for k, n in enumerate(carry) if n in stored]


def known_with(known_in: Sequence[bool], extra: set[int]) -> tuple[bool, ...]:
    """``known_in`` with the inputs ``extra`` known too."""
    return tuple(k or n in extra for n, k in enumerate(known_in))


def _nbytes(a: Any) -> int:
    return int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize
