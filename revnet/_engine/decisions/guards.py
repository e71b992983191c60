"""NaN and Inf guards that decide: a test of a value made non-finite at a tie.

A NaN/Inf test (``x != x``, ``is_finite``, ``x == inf``) is a *guard*
(:mod:`.continuity`): a non-finite value is the run-time checks' business,
and the guarded branch is taken on a region that rebuilt values approach
continuously (``where(isnan(sqrt(x)), 0, sqrt(x))``: ``sqrt`` is NaN for every
negative ``x``). Some values are non-finite only *at a tie*:
``b / where(b == 0, 0, b)`` is NaN exactly where ``b == 0`` and 1 elsewhere.
The forward pass reaches the tie, the rebuilt ``b`` misses it by rounding, and
the guarded branch jumps, from 0 to 1: that guard is a decision.

Which it is is decided from the program by evaluating the equation that makes
the tested value (through equations of one input that make nothing
non-finite, ``neg`` or ``exp``), not from a list of names: evaluated at a grid
of exact values (0, 1, -1, 2, 1/2 in each operand, every combination), and
at random finite values of every magnitude. Non-finite on the grid and never
at random values is non-finite at ties only (``div`` at 0/0, ``rem`` by 0);
non-finite at random values is a region (``sqrt``, ``log``, ``exp``'s
overflow for ``is_finite``); never non-finite passes the test through.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from revnet._engine import jaxpr as jx
from revnet._engine.cache import LRU

_GRID = (0.0, 1.0, -1.0, 2.0, 0.5)
_RANDOM = 512
# How far back through one-input equations a tested value is followed.
_DEPTH = 16
TIE, REGION, NONE, UNKNOWN = "tie", "region", "none", "unknown"
_KINDS = LRU(512)


def nonfinite_at_tie(guard: Any, producer: Callable[[Any], Any]) -> bool:
    """Whether the guard ``guard`` tests a value that is non-finite only at a
    tie (see the module doc). ``producer(var)`` is the equation making
    ``var``, or None."""
    test = _test(guard)
    if test is None:
        return False
    v = next(a for a in guard.invars if not jx.is_literal(a))
    for _ in range(_DEPTH):
        e = producer(v)
        if e is None:
            return False
        kind = _kind(e, test)
        if kind == TIE:
            return True
        ins = [a for a in e.invars if not jx.is_literal(a)]
        if kind != NONE or len(ins) != 1:
            return False
        v = ins[0]
    return False


def _test(guard: Any) -> str | None:
    """What the guard tests: ``"nan"``, ``"inf"`` or ``"nonfinite"``."""
    name = jx.primitive_name(guard)
    if name == "is_finite":
        return "nonfinite"
    if name in ("eq", "ne") and guard.invars[0] is guard.invars[1]:
        return "nan"
    if any(jx.is_literal(a) for a in guard.invars):
        return "inf"  # a comparison with an infinite literal
    return None


def _kind(eqn: Any, test: str) -> str:
    """Where ``eqn`` makes what ``test`` tests from finite inputs."""
    out = jx.aval(eqn.outvars[0]) if len(eqn.outvars) == 1 else None
    if out is None or not np.issubdtype(out.dtype, np.floating) or eqn.effects:
        return UNKNOWN
    probed = []
    for a in eqn.invars:
        if jx.is_literal(a):
            continue
        aval = jx.aval(a)
        if tuple(aval.shape) not in ((), tuple(out.shape)):
            return UNKNOWN  # not elementwise: its params may name shapes
        if not np.issubdtype(aval.dtype, np.floating):
            return UNKNOWN
        probed.append(a)
    if not probed:
        return UNKNOWN
    key = (
        jx.primitive_name(eqn),
        test,
        tuple(str(jx.aval(a).dtype) for a in probed),
        tuple(
            ("lit", jx.literal_key(a)) if jx.is_literal(a) else "var"
            for a in eqn.invars
        ),
        str(sorted((k, str(v)) for k, v in jx.key_params(eqn).items())),
    )
    found = _KINDS.get(key)
    if found is None:
        found = _probe(eqn, probed, test)
        _KINDS.put(key, found)
    return found


def _probe(eqn: Any, probed: list, test: str) -> str:
    grid = np.array(list(itertools.product(_GRID, repeat=len(probed)))).T
    rng = np.random.default_rng(0)
    size = (len(probed), _RANDOM)
    rand = rng.standard_normal(size) * 10.0 ** rng.uniform(-3, 3, size)
    try:
        on_grid = _nonfinite(eqn, probed, grid, test)
        at_random = _nonfinite(eqn, probed, rand, test)
    except Exception:  # not evaluable elementwise on samples
        return UNKNOWN
    if at_random:
        return REGION
    return TIE if on_grid else NONE


def _nonfinite(eqn: Any, probed: list, values: np.ndarray, test: str) -> bool:
    """Whether ``eqn`` gives a tested value on the samples ``values`` (one
    row per probed operand; literals keep their values)."""
    rows = iter(values)
    ins = []
    for a in eqn.invars:
        if jx.is_literal(a):
            ins.append(np.broadcast_to(jx.literal_value(a), values.shape[1:]))
        else:
            ins.append(np.asarray(next(rows), jx.aval(a).dtype))
    with jax.ensure_compile_time_eval():
        (out,) = jx.bind(eqn, *ins)
    out = np.asarray(out)
    if test == "nan":
        return bool(np.isnan(out).any())
    if test == "inf":
        return bool(np.isinf(out).any())
    return bool((~np.isfinite(out)).any())
