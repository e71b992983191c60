"""What revnet's forward passes keep for their backward passes.

A differentiated revnet function saves *residuals* for its backward pass:
``@invertible`` saves the values it closes over, its outputs and its stored
decisions (:mod:`.decisions`); revnet's loops save their constants, ``xs``,
``ys``, the final carry (the initial one when checkpointing), the carry leaves
they store at every step, the anchors and a while loop's trip count. Each
forward pass calls one hook here, :func:`invertible` or :func:`loop`, with
exactly the values it saves, when it is traced. The hooks change nothing.

* **Recording.** Inside :func:`recording` (which :func:`revnet.stored` uses)
  each hook describes every saved value as a :class:`StoredValue`: its kind,
  type, bytes, source line, reason, and how many steps it is stacked over.
  Outside, a hook returns at once unless something is stored per step.
* **Growth.** Values stacked once per step of a loop (a decision inside a
  ``scan`` over layers, a carry leaf that inversion cannot rebuild) make
  memory grow with depth or steps. When those bytes per step exceed
  :data:`GROWTH_FRACTION` of one activation (the bytes of the function's
  outputs, or of the loop's carry), a :class:`StoredGrowthWarning` names each
  source line and primitive, once per line in each trace (so every program
  traced with other shapes or step counts warns again). Anchors (asked for
  with ``anchor_every``) and the user's own ``xs`` and ``ys`` also grow with
  steps, and are reported, but never warned about.
* **Off.** Inside :func:`hooks_off` the hooks return at once, for tests:
  that a program traced there is the one traced with the hooks, and that a
  report missing a call's values fails the check against the program.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import math
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from revnet._engine import jaxpr as jx

GROWTH_FRACTION = 1 / 16
"""Warn when the bytes stored per step exceed this fraction of one activation.

At this rate the values stored over 16 steps add up to one more activation,
the size a reversible function keeps anyway: at depth 64 they would be four.
A ``bool`` mask per element of a float32 stream is 1/4 (it warns); two
``int32`` routing indices per token of a stream of 64 float32 are 1/32 (it
does not).
"""

# Kinds of stored values.
OUTPUT, CONSTANT, DECISION, KINK, INPUTS = (
    "output",
    "constant",
    "decision",
    "kink",
    "inputs at point",
)
BOUNDARY = "checked input"
ANCHOR, CARRY, INITIAL, XS, YS, TRIP, OTHER = (
    "anchor",
    "stored carry",
    "initial carry",
    "xs",
    "ys",
    "trip count",
    "other",
)
_FROM_REASON = {"decision": DECISION, "kink": KINK, "inputs": INPUTS}
# The kinds that warn when they grow: what revnet chose to store per step.
_WARNED_KINDS = frozenset({DECISION, KINK, INPUTS, CARRY})


class StoredGrowthWarning(UserWarning):
    """What a reversible function keeps grows with its depth or steps.

    Raised through :mod:`warnings` when the function is traced for
    differentiation, once per source line in each program (an identical
    message at the same line is shown once, as :mod:`warnings` does by
    default). Silence it with
    ``warnings.filterwarnings("ignore", category=revnet.StoredGrowthWarning)``
    or make it an error with ``"error"``.
    """


@dataclasses.dataclass(frozen=True)
class StoredValue:
    """One value a forward pass keeps for the backward pass.

    Attributes:
      kind: ``"output"``, ``"constant"``, ``"decision"``, ``"kink"``,
        ``"inputs at point"`` (an equation's rebuilt inputs, at which the
        backward pass evaluates it again), ``"stored carry"`` (a carry leaf
        stored at every step), ``"anchor"``, ``"checked input"`` (the input
        or initial carry the boundary check compares the rebuilt one with),
        ``"initial carry"`` (checkpointing), ``"xs"``, ``"ys"``, ``"trip
        count"``, or ``"other"`` (a residual JAX keeps outside revnet's
        functions).
      shape: its shape (stacked values included).
      dtype: its dtype.
      nbytes: its size in bytes.
      where: the source line, ``"file:line (function)"``, or ``""``.
      reason: why it is kept, in words.
      kept_by: the revnet call that keeps it and where it is called
        (``"revnet.scan at train.py:40 (loss)"``), or ``"jax"``.
      steps: the number of steps (layers) it is stacked over, the leading
        axis of its shape; None when it does not grow with steps.
      primitive: the equation it is kept for (a decision, a kink, inputs at
        a point), as ```gt``` or ```custom_jvp_call` (relu)``; ``""`` for
        the other kinds.
    """

    kind: str
    shape: tuple[int, ...]
    dtype: Any
    nbytes: int
    where: str
    reason: str
    kept_by: str
    steps: int | None = None
    primitive: str = ""

    @property
    def per_step(self) -> int:
        """Bytes per step (all its bytes when it does not grow)."""
        return self.nbytes // self.steps if self.steps else self.nbytes


_SINK: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "revnet_kept", default=None
)
_OFF: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "revnet_kept_off", default=False
)
# What :func:`warnings.warn_explicit` has shown: an identical message at the
# same line is shown once (the "default" filter), a changed one again.
_REGISTRY: dict = {}


@contextlib.contextmanager
def recording() -> Iterator[list[StoredValue]]:
    """Collects what every forward pass traced inside saves, in trace order."""
    sink: list[StoredValue] = []
    token = _SINK.set(sink)
    try:
        yield sink
    finally:
        _SINK.reset(token)


@contextlib.contextmanager
def hooks_off() -> Iterator[None]:
    """Inside the block the hooks return at once: forward passes traced there
    record nothing and warn of nothing (a testing seam: see **Off** above)."""
    token = _OFF.set(True)
    try:
        yield
    finally:
        _OFF.reset(token)


def forget_warnings() -> None:
    """Lets every message warn again (for tests)."""
    _REGISTRY.clear()


def nbytes(shape: Sequence[int], dtype: Any) -> int:
    """The bytes of an array of ``shape`` and ``dtype``."""
    size = getattr(dtype, "itemsize", None)
    if size is None:
        size = np.dtype(dtype).itemsize
    return math.prod(shape) * int(size)


def _value(kind, x, where, reason, by, steps=None, primitive="") -> StoredValue:
    shape = tuple(int(d) for d in np.shape(x))
    dtype = x.dtype if hasattr(x, "dtype") else np.result_type(x)
    if steps is not None and not shape:
        steps = None
    return StoredValue(
        kind, shape, dtype, nbytes(shape, dtype), where, reason, by, steps, primitive
    )


def _producers(jaxpr: Any) -> dict:
    return {v: e for e in jaxpr.eqns for v in e.outvars if not jx.is_dropvar(v)}


def _made_at(v: Any, producers: dict, fallback: str) -> str:
    e = None if jx.is_literal(v) else producers.get(v)
    return (jx.where(e) if e is not None else "") or fallback


# --------------------------------------------------------------------------- #
# Hooks.


def invertible(
    exposed: Any, consts: Sequence[Any], outs: Sequence[Any], given: Any = None
) -> None:
    """Hook of ``@invertible``'s forward pass, which saves ``consts`` and ``outs``.

    Args:
      exposed: the :class:`~.decisions.Exposed` jaxpr the forward pass ran.
      consts: the closed-over values it saves.
      outs: its outputs, then its ``exposed.n`` stored decisions.
      given: None, or the inputs it saves for the boundary check.
    """
    if _OFF.get():
        return
    sink = _SINK.get()
    growing = any("scan" in k.within for k in exposed.kept)
    if sink is None and not growing:
        return
    site = jx.caller_site()
    by = f"revnet.invertible at {site}" if site else "revnet.invertible"
    jaxpr, n_out = exposed.jaxpr, len(outs) - exposed.n
    made = _producers(jaxpr)
    readers: dict = {}
    for e in jaxpr.eqns:
        for a in e.invars:
            if not jx.is_literal(a):
                readers.setdefault(a, e)
    values = []
    for v, c in zip(jaxpr.invars, consts):
        where = jx.where(readers[v]) if v in readers else ""
        why = "closed over: weights and constants"
        values.append(_value(CONSTANT, c, where or site, why, by))
    for v, o in zip(jaxpr.outvars[:n_out], outs[:n_out]):
        why = "an output: the inputs are rebuilt from it"
        values.append(_value(OUTPUT, o, _made_at(v, made, site), why, by))
    for k, d in zip(exposed.kept, outs[n_out:]):
        kind = _FROM_REASON.get(k.reason, DECISION)
        steps = int(np.shape(d)[0]) if "scan" in k.within and np.ndim(d) else None
        values.append(_value(kind, d, k.where or site, _why(k), by, steps, k.label))
    why = "an input: its rebuilt copy is checked against it (set_boundary_check)"
    values += [_value(BOUNDARY, g, site, why, by) for g in given or ()]
    _finish(sink, values, sum(v.nbytes for v in values if v.kind == OUTPUT))


def loop(
    kind: str,
    sp: Any,
    mode: Any,
    every: int | None,
    decided: Sequence[Any],
    consts: Sequence[Any],
    xs: Sequence[Any],
    ran: Any,
) -> None:
    """Hook of a revnet loop's forward pass, which saves ``consts``, ``xs``, ``ran``.

    Args:
      kind: ``"scan"`` or ``"while_loop"``.
      sp: the loop as a scan over its body (:class:`~.jaxpr.ScanParams`).
      mode: its backward mode (``kind``: invert, store or checkpoint; which
        carry leaves are ``stored``).
      every: the anchor spacing, or None.
      decided: the records of the decisions the body returns as its last
        ``ys`` (:class:`~.decisions.Kept`).
      consts, xs: the body's constants and the stacked ``xs`` it saves.
      ran: what the forward loop saves (:class:`~.loops.forward.Ran`): the
        trip count, the final (checkpointing: initial) carry, the ``ys``, the
        stored carry leaves and the anchors.
    """
    if _OFF.get():
        return
    sink = _SINK.get()
    growing = bool(decided) or bool(ran.stored)
    if sink is None and not growing:
        return
    site = jx.caller_site()
    by = f"revnet.{kind} at {site}" if site else f"revnet.{kind}"
    length = sp.length
    values = [_value(CONSTANT, c, site, "closed over by the body", by) for c in consts]
    values += [_value(XS, x, site, "the scanned inputs", by, length) for x in xs]
    if ran.steps is not None:
        why = "the steps taken: the backward pass runs as many"
        values.append(_value(TRIP, ran.steps, site, why, by))
    if mode.kind == "checkpoint":
        why = "the initial carry: checkpointing recomputes from it"
        values += [_value(INITIAL, c, site, why, by) for c in ran.final]
    else:
        why = "the final carry: the walk back starts there"
        values += [_value(OUTPUT, c, site, why, by) for c in ran.final]
    n_ys = len(ran.ys) - len(decided)
    values += [
        _value(YS, y, site, "the stacked outputs", by, length) for y in ran.ys[:n_ys]
    ]
    for k, d in zip(decided, ran.ys[n_ys:]):
        kind_ = _FROM_REASON.get(k.reason, DECISION)
        why = _why(k) + ", one per step"
        rows = int(np.shape(d)[0]) if length is None else length  # max_steps
        values.append(_value(kind_, d, k.where or site, why, by, rows, k.label))
    made = _producers(sp.body.jaxpr)
    carry_out = sp.body.jaxpr.outvars[: sp.num_carry]
    leaves = [n for n, s in enumerate(mode.stored) if s]
    for n, buf in zip(leaves, ran.stored):
        why = f"carry leaf {n}: inversion cannot rebuild it"
        at = _made_at(carry_out[n], made, site)
        values.append(_value(CARRY, buf, at, why, by, int(np.shape(buf)[0])))
    for a in ran.anchors:
        rows = int(np.shape(a)[0])
        if rows == 1:  # the initial carry alone: the boundary check, a monitor
            why = "the initial carry: its rebuilt copy is checked against it"
            values.append(_value(BOUNDARY, a, site, why, by, None))
            continue
        why = f"the carry every {every} steps (anchor_every)"
        values.append(_value(ANCHOR, a, site, why, by, rows))
    carry_bytes = sum(nbytes(np.shape(c), c.dtype) for c in ran.final)
    _finish(sink, values, carry_bytes)


def _why(k: Any) -> str:
    where = f" inside {'/'.join(k.within)}" if k.within else ""
    if k.reason == "kink":
        return f"kink {k.label}{where}: kinks='store'"
    if k.reason == "inputs":
        return f"the inputs of {k.label}{where}: it is evaluated there again"
    return f"{k.label}{where} jumps: stored, not recomputed"


# --------------------------------------------------------------------------- #
# Growth.


def _finish(sink: list | None, values: list[StoredValue], activation: int) -> None:
    if sink is not None:
        sink.extend(values)
    growing = [v for v in values if v.steps and v.kind in _WARNED_KINDS]
    per_step = sum(v.per_step for v in growing)
    if not growing or per_step <= GROWTH_FRACTION * activation:
        return
    lines: dict[tuple, list[StoredValue]] = {}
    for v in growing:
        lines.setdefault(jx.site_line(v.where or v.kept_by), []).append(v)
    for line, group in lines.items():
        _warn(line, group, per_step, activation)


_NOUNS = {
    DECISION: ("a decision", "decisions"),
    KINK: ("a kink's branch", "kinks' branches"),
    INPUTS: ("an equation's inputs", "equations' inputs"),
    CARRY: ("a carry leaf", "carry leaves"),
}


def _warn(
    line: tuple[str, int], group: list[StoredValue], total: int, activation: int
) -> None:
    first = group[0]
    counts = collections.Counter(
        (v.kind, f"{_dtype_name(v.dtype)}{list(v.shape[1:])}", v.primitive)
        for v in group
    )
    what = ", ".join(
        (f"{_NOUNS[kind][0]} {t}" if n == 1 else f"{n} {_NOUNS[kind][1]} {t}")
        + (f" of {p}" if p else "")
        for (kind, t, p), n in counts.items()
    )
    jumps = sorted({v.primitive for v in group if v.kind in (DECISION, INPUTS)})
    where = first.where or first.kept_by
    mine = sum(v.per_step for v in group)
    share = f"{100 * total / activation:.0f}%" if activation else "all"
    more = f" ({total:,} per step in all)" if total != mine else ""
    kinds = {v.kind for v in group}
    if kinds <= {CARRY}:
        fix = (
            "make that leaf's update invertible from the other leaves, or pass "
            "mode='checkpoint' (it keeps `checkpoints` carries instead)"
        )
    elif kinds <= {KINK}:
        fix = (
            "leave kinks at its default, 'recompute' (kinks='store' stores the "
            "branch of every kink)"
        )
    else:
        named = " and ".join(p for p in jumps if p) or "it"
        fix = (
            f"pass decisions='recompute' (nothing is stored; {named} "
            f"jump{'s' if len(jumps) < 2 else ''} rather than vary smoothly, "
            "so recomputing is safe only where the rebuilt inputs stay on the "
            "same side of every tie: a decision that flips makes the rebuilt "
            "carry drift, which the boundary check reports)"
        )
    message = (
        f"{first.kept_by} stores, at every step ({first.steps} "
        f"step{'' if first.steps == 1 else 's'}), {what} "
        f"made at {where}: {mine:,} bytes per step{more}, {share} of one "
        f"activation ({activation:,} bytes), so memory grows with depth or "
        f"steps. To avoid it, {fix}. revnet.stored(f, *args) lists what is kept."
    )
    warnings.warn_explicit(message, StoredGrowthWarning, *line, registry=_REGISTRY)


def _dtype_name(dtype: Any) -> str:
    return str(getattr(dtype, "name", dtype))
