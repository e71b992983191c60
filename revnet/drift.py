"""Drift monitor: how far a reversible backward pass's rebuilt carries are off.

A reversible backward pass rebuilds each layer's input from its output, and in
floating point every step adds rounding error that all earlier steps inherit.
With anchors (``anchor_every=k`` in :func:`revnet.scan` and
:class:`revnet.blocks.ReversibleSequence`) the forward pass stores the carry
every ``k`` steps, and the backward pass continues from each stored carry, so
error accumulates over at most ``k`` steps. At each anchor the backward pass
has both the carry it rebuilt and the stored one; their relative L2 distance
is the *drift* over that segment, the reconstruction error that the gradients
of the segment's steps were computed with.

A :class:`DriftMonitor` passed as ``drift=`` receives those distances from
every backward pass, through one ``jax.debug.callback`` at the end of it, and
may warn or raise when one exceeds a tolerance. It works under ``jit``,
``vmap`` and sharded programs; under a global mesh (``jax.set_mesh``) the
callback runs on every device, and in a multi-process run each process's
monitor records one reading per backward pass and warns or raises itself
(``runtime_checks.host_callback``)::

    monitor = revnet.DriftMonitor(tolerance=1e-3)
    def loss(x):
        seq = ReversibleSequence(block, 128, anchor_every=16, drift=monitor)
        return jnp.sum(seq(x) ** 2)
    loss = hk.transform(loss)
    grads = jax.jit(jax.grad(loss.apply))(loss.init(key, x), None, x)
    jax.effects_barrier()  # host callbacks run asynchronously
    monitor.latest  # drift at each of the 8 anchors, first step first

Cost: with a monitor, one L2 distance over the carry per anchor (a few
elementwise operations on ``ceil(depth / k)`` carries, next to the body's
VJP at every step) and one host callback, a synchronisation point, per
backward pass. Without ``anchor_every``, a monitored loop stores its initial
carry (one carry of memory) and reports the reconstruction error of the whole
loop. Without a monitor, the boundary check (on by default,
:func:`set_boundary_check`) still compares the rebuilt input with the real one
and warns past a tolerance derived from the dtype. The monitor is bound when the
function is traced: a jitted function keeps reporting to the monitor it was
traced with. Readings arrive asynchronously, as the compiled program runs:
``jax.effects_barrier()`` waits for them. Loops that checkpoint
(:func:`revnet.scan` with ``mode="checkpoint"`` or a body that is not invertible)
recompute exactly and report nothing.
"""

from __future__ import annotations

import math
import numbers
import threading
import warnings
from typing import Any, NamedTuple

import numpy as np

from revnet._engine import boundary

DriftError = boundary.DriftError
DriftWarning = boundary.DriftWarning
set_boundary_check = boundary.set_boundary_check

__all__ = [
    "DriftError",
    "DriftMonitor",
    "DriftReading",
    "DriftWarning",
    "set_boundary_check",
]


class DriftReading(NamedTuple):
    """The drift of one backward pass of one loop.

    Attributes:
      source: the loop (its body's name, or the module's name).
      drift: relative reconstruction error at each anchor, first step first.
        Under ``vmap`` a ``revnet.scan`` or ``@invertible`` call runs as one
        batched call and sends one reading for the batch (the error over all
        its elements); a ``revnet.while_loop`` sends one per element.
    """

    source: str
    drift: np.ndarray


class DriftMonitor:
    """Receives the drift of anchored reversible backward passes.

    Pass it as ``drift=`` to :func:`revnet.scan`, :func:`revnet.while_loop`
    (with ``max_steps``), ``ReversibleSequence``, ``RevNet`` or
    ``ReversibleTransformer``. Each backward pass adds one
    :class:`DriftReading` (:attr:`readings`, :attr:`latest`, :meth:`max`).

    Args:
      tolerance: None, or the largest relative reconstruction error allowed
        at an anchor; a larger (or non-finite) one warns or raises.
      on_exceed: ``"warn"`` (a :class:`DriftWarning`) or ``"raise"`` (a
        :class:`DriftError`, raised where the backward pass's result is
        read: by ``jax.grad`` itself in eager code, by the jitted call or
        ``block_until_ready`` under ``jit``, there wrapped in JAX's
        runtime error).

    Raises:
      TypeError: If ``tolerance`` is not a number or None.
      ValueError: If ``tolerance`` is not positive and finite, or
        ``on_exceed`` is neither ``"warn"`` nor ``"raise"``.

    Example:

    >>> import jax, jax.numpy as jnp, revnet
    >>> monitor = revnet.DriftMonitor(tolerance=1e-2, on_exceed="raise")
    >>> def step(h, w):                       # an additive coupling
    ...     h1, h2 = h
    ...     y1 = h1 + jnp.tanh(h2 @ w)
    ...     y2 = h2 + jnp.tanh(y1 @ w)
    ...     return (y1, y2), jnp.sum(y2)
    >>> def loss(weights, x):
    ...     carry, ys = revnet.scan(step, (x, x), weights, anchor_every=8,
    ...                             drift=monitor)
    ...     return jnp.sum(carry[1] ** 2) + jnp.sum(ys)
    >>> weights = 0.3 * jax.random.normal(jax.random.key(0), (32, 4, 4))
    >>> grads = jax.grad(loss)(weights, jnp.ones((2, 4)))
    >>> jax.effects_barrier()                 # readings come from a host callback
    >>> monitor.latest.shape                  # 32 steps, an anchor every 8
    (4,)
    >>> bool(monitor.max() < 1e-2)
    True
    """

    def __init__(self, tolerance: float | None = None, on_exceed: str = "warn"):
        """Constructs the monitor (arguments and errors: see the class)."""
        if tolerance is not None:
            if isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real):
                raise TypeError(
                    "DriftMonitor: tolerance must be a positive number or None, "
                    f"got {tolerance!r}"
                )
            if not (math.isfinite(tolerance) and tolerance > 0):
                raise ValueError(
                    "DriftMonitor: tolerance must be positive and finite, "
                    f"got {tolerance!r}"
                )
            tolerance = float(tolerance)
        if on_exceed not in ("warn", "raise"):
            raise ValueError(
                f"DriftMonitor: on_exceed must be 'warn' or 'raise', got {on_exceed!r}"
            )
        self.tolerance = tolerance
        self.on_exceed = on_exceed
        self._readings: list[DriftReading] = []
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        """The settings and readings (``copy.deepcopy``, ``pickle``); the lock
        is made anew by :meth:`__setstate__`."""
        with self._lock:
            state = dict(self.__dict__, _readings=list(self._readings))
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def readings(self) -> list[DriftReading]:
        """Every reading so far, oldest first."""
        with self._lock:
            return list(self._readings)

    @property
    def latest(self) -> np.ndarray | None:
        """The drift at each anchor of the latest backward pass, or None."""
        with self._lock:
            return self._readings[-1].drift if self._readings else None

    def max(self) -> float:
        """The largest drift seen so far (0.0 before any reading)."""
        with self._lock:
            values = [np.max(r.drift, initial=0.0) for r in self._readings]
        return float(max(values, default=0.0))

    def clear(self) -> None:
        """Forgets the readings."""
        with self._lock:
            self._readings.clear()

    def reporter(self, source: str):
        """The function a loop named ``source`` reports its drift to."""

        def report(drift: Any, used: Any) -> None:
            drift = np.asarray(drift)[: int(used)]
            if drift.ndim == 2:  # a loop's readings: (pooled, by leaf)
                drift = drift[:, 0]
            self._record(source, drift)

        return report

    def _record(self, source: str, drift: np.ndarray) -> None:
        with self._lock:
            self._readings.append(DriftReading(source, drift))
        if self.tolerance is None or drift.size == 0:
            return
        bad = ~(drift <= self.tolerance)  # non-finite drift counts as too large
        if not bad.any():
            return
        worst = np.unravel_index(
            np.argmax(np.where(np.isfinite(drift), drift, np.inf)), drift.shape
        )
        message = (
            f"revnet: reconstruction drift {float(drift[worst]):.3g} at anchor "
            f"{worst[-1]} of {source} exceeds the tolerance {self.tolerance:g}; "
            "store anchors more often (a smaller anchor_every) or use a "
            "better-conditioned block"
        )
        if self.on_exceed == "raise":
            raise DriftError(message)
        warnings.warn(message, DriftWarning, stacklevel=2)
