"""The boundary check: a backward pass's rebuilt input against the real one.

Every reversible backward pass (an ``@invertible`` call, a stack, an inverted
:func:`revnet.scan` or :func:`revnet.while_loop`) ends by rebuilding the input
its caller passed in. Rebuilt values carry the rounding error of every step
in between; in a well-conditioned program it stays near the dtype's
precision, but a step that divides by a factor of modulus below 1 on every
reversed step (a damped update, an absorbing boundary) or a chaotic one
amplifies it until the rebuilt values, and the gradients computed at them,
are far off or not finite, with nothing else to show for it.

So by default the backward pass compares the input it rebuilt with the one
the caller passed (kept for that: one carry of memory) by their relative L2
distance, and past a tolerance derived from the dtype, the square root of
its machine epsilon (half its significant digits lost: 3.5e-4 in float32,
1.5e-8 in float64), warns (:class:`DriftWarning`) or raises
(:class:`DriftError`) in one line naming the call, the error and what to do.
:func:`set_boundary_check` sets what happens, for the functions traced after
it: ``"warn"`` (the default), ``"raise"`` or ``"off"``.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from revnet._engine import jaxpr as jx
from revnet._engine.cotangents import is_float

MODES = ("warn", "raise", "off")
_SETTING = ["warn"]


class DriftError(RuntimeError):
    """A reversible backward pass rebuilt a carry further off than allowed."""


class DriftWarning(RuntimeWarning):
    """A reversible backward pass rebuilt a carry further off than allowed."""


def set_boundary_check(mode: str) -> None:
    """Sets what a reversible backward pass does when the input it rebuilt is
    further from the real one than the dtype's tolerance.

    Args:
      mode: ``"warn"`` (the default: a :class:`DriftWarning`), ``"raise"`` (a
        :class:`DriftError`, raised where the backward pass's result is read;
        under ``jit`` JAX wraps it in its runtime error) or ``"off"`` (no
        check, no carry kept). Applies to functions traced after the call.

    Raises:
      ValueError: If ``mode`` is not one of these.

    Example:
      >>> import revnet
      >>> revnet.set_boundary_check("raise")
      >>> revnet.set_boundary_check("warn")
    """
    if mode not in MODES:
        raise ValueError(
            f"set_boundary_check: mode must be one of {MODES}, got {mode!r}"
        )
    _SETTING[0] = mode


def active() -> bool:
    """Whether backward passes traced now check their rebuilt input."""
    return _SETTING[0] != "off"


def tolerance(values: Sequence[Any]) -> float:
    """The largest relative error allowed for a carry of ``values``: the square
    root of the machine epsilon of its least precise float leaf."""
    dtypes = [getattr(v, "dtype", None) or jnp.result_type(v) for v in values]
    eps = [float(jnp.finfo(d).eps) for d in dtypes if jnp.issubdtype(d, jnp.inexact)]
    return math.sqrt(max(eps, default=float(jnp.finfo(jnp.float32).eps)))


def norms(values: Sequence[Any]) -> list:
    """The L2 norm of each floating-point leaf of ``values`` (float32 at
    least): the scales :func:`distances` may measure against."""
    return [_norm(jnp.asarray(v)) for v in values if is_float(v)]


def distances(
    a: Sequence[Any], b: Sequence[Any], scale: Sequence[Any] | None = None
) -> tuple[jax.Array, jax.Array]:
    """Two relative L2 distances ``|a - b| / |b|`` over the floating-point
    leaves, from one pass over them (float32 each; 0 without float leaves):

    * pooled: over all the leaves together (0 when ``b`` is 0), what a
      :class:`revnet.DriftMonitor` reads;
    * by leaf: the largest, each leaf measured against its own size, so that
      a leaf of small values (fields that start at zero) is not drowned by a
      large constant one: its norm, or ``scale``'s (one norm per float leaf,
      :func:`norms`: a loop's final carry) where larger. A leaf of size 0 is
      measured against the largest size of all; all zero, the distance is
      absolute. What the boundary check reads.
    """
    # No dtype promotion (the caller may run under strict promotion): each
    # leaf in its own dtype, at least float32; the sums in the widest one.
    pairs = [(jnp.asarray(x), y) for x, y in zip(a, b) if is_float(x)]
    if not pairs:
        return jnp.float32(0.0), jnp.float32(0.0)
    pairs = [(x.astype(_at_least_f32(x.dtype)), y) for x, y in pairs]
    wide = max((x.dtype for x, _ in pairs), key=lambda d: np.dtype(d).itemsize)
    err2 = [_squares(x - jnp.asarray(y).astype(x.dtype)).astype(wide) for x, y in pairs]
    size2 = [_squares(jnp.asarray(y).astype(x.dtype)).astype(wide) for x, y in pairs]
    num, den = sum(err2), sum(size2)
    pooled = jnp.where(
        den > 0, jnp.sqrt(num / jnp.where(den > 0, den, 1)), jnp.sqrt(num)
    )
    errors, sizes = [jnp.sqrt(e) for e in err2], [jnp.sqrt(s) for s in size2]
    if scale is not None:
        sizes = [
            jnp.maximum(s, jnp.asarray(t).astype(wide)) for s, t in zip(sizes, scale)
        ]
    largest = functools.reduce(jnp.maximum, sizes)
    ratios = []
    for e, s in zip(errors, sizes):
        s = jnp.where(s > 0, s, largest)
        ratios.append(jnp.where(s > 0, e / jnp.where(s > 0, s, 1), e))
    by_leaf = functools.reduce(jnp.maximum, ratios)
    return pooled.astype(jnp.float32), by_leaf.astype(jnp.float32)


def _squares(x: jax.Array) -> jax.Array:
    """The sum of squares of ``x``, in its dtype (float32 at least)."""
    x = x.astype(_at_least_f32(x.dtype))
    return jnp.sum(jnp.square(x))


def _norm(x: jax.Array) -> jax.Array:
    """The L2 norm of ``x``, in its dtype (float32 at least)."""
    return jnp.sqrt(_squares(x))


def _at_least_f32(dtype: Any) -> Any:
    return dtype if np.dtype(dtype).itemsize >= 4 else np.dtype(np.float32)


def reporter(
    source: str,
    values: Sequence[Any],
    every: int | None = None,
    *,
    mode: str | None = None,
):
    """The function ``report(drift, used)`` a backward pass of ``source``
    sends the relative error at its anchors to (anchor ``j`` is the carry
    before step ``j * every``; the first is its input), or None when the
    check is off. ``values``: the carry's leaves (their dtypes set the
    tolerance); ``every``: the loop's own anchor spacing, or None; ``mode``:
    the check's mode for this loop, if not the setting's."""
    armed = mode is not None and _SETTING[0] == "off"
    mode = mode or _SETTING[0]
    if mode == "off" or _per_device():
        return None
    tol = tolerance(values)
    # The user's line that called the loop or function: the warning points
    # there, not at the callback that reports it.
    site = jx.caller_site()
    if site:
        source = f"{source} at {site}"

    def report(drift: Any, used: Any) -> None:
        drift = np.asarray(drift)[: int(used)]
        if drift.ndim == 2:  # a loop's readings: (pooled, by leaf) at each anchor
            drift = drift[:, 1]
        if drift.size == 0:
            return
        bad = ~(drift <= tol)  # non-finite drift counts as too large
        if not bad.any():
            return
        # The backward pass runs from the end: the last anchor past the
        # tolerance is where it was first detectable.
        last = int(np.flatnonzero(bad)[-1])
        worst = float(np.max(np.where(np.isfinite(drift), drift, np.inf)))
        step = None if every is None or drift.size < 2 else last * every
        message = _message(source, worst, tol, step, armed)
        if mode == "raise":
            raise DriftError(message)
        warnings.warn_explicit(message, DriftWarning, *jx.site_line(site))

    return report


def _per_device() -> bool:
    """Inside a ``shard_map`` body, where each device holds only its shard
    and a host callback sees per-device values: the check is not made there
    (a loop or function around the ``shard_map`` is checked)."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and jax.sharding.AxisType.Manual in mesh.axis_types


def chained(*reports: Any) -> Any:
    """One report calling each of ``reports`` that is not None (or None)."""
    reports = tuple(r for r in reports if r is not None)
    if len(reports) < 2:
        return reports[0] if reports else None

    def report(drift: Any, used: Any) -> None:
        for r in reports:
            r(drift, used)

    return report


def _message(
    source: str, worst: float, tol: float, step: int | None, armed: bool = False
) -> str:
    where = "" if step is None else f" (first past it at the anchor before step {step})"
    more = "anchors (anchor_every=k)" if step is None else "a smaller anchor_every"
    return (
        f"revnet: {source} rebuilt its input with relative error {worst:.3g}, "
        f"over the tolerance {tol:.2g} of its dtype{where}, so its gradients may be "
        f"wrong; likely cause: a step that is not stably invertible (it divides by "
        f"a factor of modulus below 1, as damping or an absorbing boundary does, "
        f"or it is chaotic); try: {more}, exact mode (revnet.exact), or "
        + (
            "mode='checkpoint' (checked although the check is off: mode='auto' "
            "inverted a step that divides by a factor below 1; mode='invert' "
            "inverts it unchecked)"
            if armed
            else "mode='checkpoint' (revnet.set_boundary_check('off') silences this)"
        )
    )


__all__ = [
    "DriftError",
    "DriftWarning",
    "active",
    "chained",
    "norms",
    "distances",
    "reporter",
    "set_boundary_check",
    "tolerance",
]
