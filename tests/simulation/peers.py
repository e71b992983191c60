"""What every peer's test checks: each revnet configuration of a time-stepper
gives the reference's gradient, or says in one line that it cannot.

The reference is ``jax.grad`` of the same step under ``jax.lax.scan`` with
``jax.checkpoint`` (the same float program, differentiated by JAX). Its
tolerance is the reference's own condition: how far it moves when the
initial state moves by a few units of the dtype's rounding, times ten; and
never below the square root of the dtype's machine epsilon, the error the
boundary check allows a rebuilt input (half the digits: 3.5e-4 in float32,
1.5e-8 in float64). A configuration either

* returns finite gradients within that tolerance of the reference, or
* is refused in one line: a ``NotInvertibleError`` at trace time (a second
  line starting ``try:`` allowed), or the boundary check's ``DriftWarning``
  (the default) for a rebuilt input past the dtype's tolerance.

Each runs as a user runs it: under ``jit``, run-time checks off (the
library's default), the boundary check at its default.

Never NaN, and never a gradient off by more than the tolerance in silence.
"""

from __future__ import annotations

import functools
import itertools
import re
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import revnet
from tests.helpers import runtime_checks

EXTRA = "pip install -e '.[simulation]'"
MODES = ("auto", "invert", "store", "checkpoint")
DECISIONS = ("store", "recompute")


def require(module: str) -> Any:
    """``module``, or a skip naming the simulation extra that brings it."""
    return pytest.importorskip(
        module, reason=f"{module} comes with the simulation extra: {EXTRA}"
    )


def configurations(anchor: int) -> list[dict]:
    """Every ``mode`` x ``decisions`` x anchors (none, every ``anchor``)."""
    return [
        dict(mode=m, decisions=d, anchor_every=a)
        for m, d, a in itertools.product(MODES, DECISIONS, (None, anchor))
    ]


def checkpointed(f, init, xs, length=None):
    """The reference loop: ``lax.scan`` of ``jax.checkpoint(f)``."""
    return jax.lax.scan(jax.checkpoint(f), init, xs, length=length)


def relative(a: Any, b: Any) -> float:
    """Largest absolute difference over the largest entry, over all leaves."""
    a, b = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)]) for t in (a, b))
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def reference(
    loss: Callable[[Callable, Any], Any], params: Any, nudge: Callable[[Any], Any]
) -> tuple[Any, float]:
    """The reference gradient of ``loss(scan, params)``, and its tolerance:
    ten times its change under ``nudge(params)`` (the initial state moved by a
    few roundings), at least the square root of the dtype's epsilon."""
    grad = jax.jit(jax.grad(functools.partial(loss, checkpointed)))
    want = grad(params)
    moved = grad(nudge(params))
    dtype = jax.tree.leaves(params)[0].dtype
    tol = max(10 * relative(moved, want), float(np.sqrt(jnp.finfo(dtype).eps)))
    return want, tol


def outcome(loss: Callable, params: Any, options: dict, want: Any, tol: float) -> str:
    """What ``revnet.scan(**options)`` gives, checked to be one of the allowed
    two: ``"refused"`` (one line) or ``"within"`` the tolerance."""
    scan = functools.partial(revnet.scan, **options)
    # As users run it: run-time checks off (the library's default; the suite
    # turns them on), the boundary check at its default.
    with runtime_checks(False), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.simplefilter("ignore", revnet.StoredGrowthWarning)
        try:
            got = jax.jit(jax.grad(functools.partial(loss, scan)))(params)
            jax.block_until_ready(got)
            jax.effects_barrier()
        except revnet.NotInvertibleError as e:
            lines = str(e).split("\n")
            assert len(lines) == 1 or (
                len(lines) == 2 and lines[1].startswith("try: ")
            ), (options, str(e))
            return "refused"
    drift = [str(w.message) for w in caught if w.category is revnet.DriftWarning]
    if drift:
        assert all("\n" not in m for m in drift), drift
        return "refused"
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(got)), options
    error = relative(got, want)
    assert error <= tol, (
        f"{options}: gradient off by {error:.3g} (tolerance {tol:.3g}), silently"
    )
    return "within"


def check_all(
    loss: Callable, params: Any, nudge: Callable, anchor: int, extra: tuple = ()
) -> dict:
    """:func:`outcome` of every configuration (and of ``extra`` ones); the
    outcomes by configuration."""
    want, tol = reference(loss, params, nudge)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(want))
    # Configurations that make the same program (``decisions`` where the step
    # decides nothing, anchors under ``mode="checkpoint"``) have one outcome:
    # each distinct program is compiled and run once.
    outcomes, by_program = {}, {}
    for o in [*configurations(anchor), *extra]:
        key = program(loss, params, o)
        if key not in by_program:
            by_program[key] = outcome(loss, params, o, want, tol)
        outcomes[tuple(sorted(o.items()))] = by_program[key]
    return outcomes


def program(loss: Callable, params: Any, options: dict) -> str:
    """The gradient program of ``revnet.scan(**options)``, as text: its
    forward and backward passes (the custom VJP's backward is traced into
    it), with Python objects' addresses left out."""
    scan = functools.partial(revnet.scan, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            text = str(jax.make_jaxpr(jax.grad(functools.partial(loss, scan)))(params))
        except revnet.NotInvertibleError as e:
            text = f"refused: {e}"
    return re.sub(r" at 0x[0-9a-f]+", "", text)


def nudged(x: jax.Array) -> jax.Array:
    """``x`` moved by about four roundings of its dtype, relatively."""
    return x * (1 + 4 * jnp.finfo(x.dtype).eps)
