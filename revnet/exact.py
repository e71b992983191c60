"""Exact mode: additive updates on a fixed-point grid, rebuilt bit for bit.

In floating point, ``y = x + d`` followed by ``x = y - d`` loses the low bits
of ``x`` whenever ``y`` needs more mantissa than the format has, so a deep
reversible stack drifts (see the numerical-accuracy guide). On a grid it
cannot: if ``x`` and ``d`` are multiples of ``2**-bits`` and ``|x + d| <
2**(m - bits)`` (``m`` the mantissa's bits, 24 in float32), every sum and
difference is exact, so the inverse gives ``x`` back bit for bit, at any
depth and any number of steps.

* :func:`grid` rounds a value onto the grid ``2**-bits``, with a
  straight-through gradient (the identity). A stream is rounded once, where
  it enters; inside :func:`revnet.invertible` the rounding is inverted as the
  identity, so what comes back is the rounded value.
* :func:`add` is ``x + grid(d)`` for a stream ``x`` on the grid: the exact
  additive update of a coupling (``y1 = x1 + F(x2)``) or of a leapfrog step
  (``p += dt * force(q)``). Its inverse is ``y - grid(d)``; the increment is
  computed again from rebuilt values, which are the forward's bit for bit, so
  nothing is stored. Where ``|y|`` reaches the exact range the inverse gives
  NaN instead of an inexact value, and with :func:`revnet.set_runtime_checks`
  on the backward pass raises one line naming the update.

The couplings' ``exact=True`` (every front door's ``AdditiveCoupling``,
Haiku's ``RevNet`` and ``ReversibleTransformer``, the NNX and Equinox
transformer blocks) use these two. Only additive updates can be exact: a
product of grid values needs more bits than the grid holds, so an affine
coupling refuses ``exact=True``.

The default grid leaves a range of ``|x| < 16384`` in every dtype:
``2**-10`` in float32, ``2**-39`` in float64. 16-bit floats are refused: their
mantissa (8 bits in bfloat16, 11 in float16) leaves no useful grid. Keep the
stream in float32 and compute the residual functions in bfloat16
(``compute_dtype``) instead.

The promise rests on one premise: an increment computed again in the
backward pass rounds to the same grid point as in the forward pass. It does
when the residual functions give the same bits again, as MLPs do on XLA:CPU;
a reduction that XLA sums in another order in the backward program (a
LayerNorm, a softmax) changes the last bit, which moves the rounding only
within that bit of a tie. The numerical-accuracy guide gives what was
measured; anchors with a :class:`revnet.DriftMonitor` read any slip. On a
GPU, ask XLA for deterministic operations (``--xla_gpu_deterministic_ops``).

Example:

>>> import jax, jax.numpy as jnp, revnet
>>> def step(x):                       # one exact additive coupling
...     a, b = jnp.split(x, 2)
...     a = revnet.exact.add(a, jnp.tanh(b))
...     b = revnet.exact.add(b, jnp.sin(a))
...     return jnp.concatenate([a, b])
>>> x = revnet.exact.grid(jnp.linspace(-1.0, 1.0, 8))
>>> y = x
>>> for _ in range(100):
...     y = step(y)
>>> back = y
>>> for _ in range(100):
...     (back,) = revnet.inverse(step, back)(back)
>>> bool(jnp.all(back == x))
True
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from revnet._checks import check_int
from revnet._engine import exact as exact_calls

__all__ = ["RANGE_BITS", "add", "bits_for", "grid", "limit"]

RANGE_BITS = 14
"""The default grid leaves ``|x| < 2**RANGE_BITS`` (16384) exact in any dtype."""


def _mantissa(where: str, dtype: Any) -> int:
    """The mantissa's bits (the implicit one included) of a stream's dtype.

    Raises:
      TypeError: If ``dtype`` is not float32 or float64.
    """
    dtype = jnp.dtype(dtype)
    if dtype in exact_calls.MANTISSA:
        return exact_calls.MANTISSA[dtype]
    if jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"{where}: exact mode needs a float32 or float64 stream, got {dtype}: "
            f"its mantissa ({jnp.finfo(dtype).nmant + 1} bits) leaves no useful "
            "grid; keep the stream in float32 and compute the residual "
            "functions in the narrow dtype (compute_dtype)"
        )
    raise TypeError(f"{where}: exact mode needs a floating point stream, got {dtype}")


def bits_for(
    dtype: Any, bits: int | None = None, *, where: str = "revnet.exact"
) -> int:
    """The grid's bits for a stream of ``dtype``: ``bits``, checked, or the
    default, which leaves ``|x| < 2**RANGE_BITS`` (10 in float32, 39 in
    float64).

    Args:
      dtype: The stream's dtype.
      bits: None, or the grid's bits ``k`` (the grid is ``2**-k``).
      where: The caller, for error messages.

    Returns:
      The bits.

    Raises:
      TypeError: If ``dtype`` is not float32 or float64, or ``bits`` is not an
        integer.
      ValueError: If ``bits`` leaves less than one bit of range.
    """
    m = _mantissa(where, dtype)
    if bits is None:
        return m - RANGE_BITS
    bits = check_int(where, "exact_bits", bits, minimum=0)
    if bits >= m:
        raise ValueError(
            f"{where}: exact_bits must be below the {m}-bit mantissa of "
            f"{jnp.dtype(dtype).name} (it leaves |x| < 2**(mantissa - exact_bits) "
            f"exact), got {bits}"
        )
    return bits


def limit(dtype: Any, bits: int) -> float:
    """The exact range: sums on the grid ``2**-bits`` are exact while ``|x| <
    limit``, ``2**(mantissa - bits)``.

    Raises:
      TypeError: If ``dtype`` is not float32 or float64.
    """
    _mantissa("revnet.exact.limit", dtype)
    return exact_calls.limit(dtype, bits)


def _round(x: jax.Array, bits: int) -> jax.Array:
    """``x`` rounded to the nearest multiple of ``2**-bits`` (ties to even).
    Scaling by a power of two is exact, so only ``round`` rounds."""
    return jnp.round(x * 2.0**bits) * 2.0**-bits


def _straight_through(fun: Any) -> Any:
    """``fun`` as a ``custom_jvp`` whose derivative is the sum of its tangents
    (the identity for one input): the straight-through estimator."""
    marked = jax.custom_jvp(fun)

    def jvp(primals, tangents):
        return marked(*primals), sum(tangents[1:], tangents[0])

    marked.defjvp(jvp)
    return marked


@functools.cache
def _grid_fn(bits: int) -> Any:
    def grid(x):
        return _round(x, bits)

    grid.__name__ = exact_calls.GRID  # the engine solves it as the identity
    return _straight_through(grid)


@functools.lru_cache(maxsize=256)  # one per layer name
def _add_fn(bits: int, label: str) -> Any:
    def add(x, d):
        return x + _round(d, bits)

    add.__name__ = exact_calls.add_name(bits, label)  # the engine guards its inverse
    return _straight_through(add)


def grid(x: jax.Array, *, bits: int | None = None) -> jax.Array:
    """Rounds ``x`` onto the grid ``2**-bits``, with a straight-through gradient.

    Args:
      x: A float32 or float64 array.
      bits: The grid's bits ``k`` (the grid is ``2**-k``); None: the default
        (:func:`bits_for`).

    Returns:
      ``round(x * 2**k) / 2**k``. Its derivative is the identity, and inside
      :func:`revnet.invertible` it is inverted as the identity.

    Raises:
      TypeError: If ``x`` is not float32 or float64.

    Example:

    >>> import jax.numpy as jnp, revnet
    >>> revnet.exact.grid(jnp.array([0.1, 1 / 3]), bits=4)
    Array([0.125 , 0.3125], dtype=float32)
    """
    x = jnp.asarray(x)
    return _grid_fn(bits_for(x.dtype, bits, where="revnet.exact.grid"))(x)


def add(
    x: jax.Array,
    d: jax.Array,
    *,
    bits: int | None = None,
    name: str = "revnet.exact.add",
) -> jax.Array:
    """``x + grid(d)``: an additive update that is inverted bit for bit.

    Args:
      x: The stream, on the grid (from :func:`grid` or another exact update).
      d: The increment, computed from values known when the update is
        inverted (the other half of a coupling, the other variable of a
        leapfrog step); rounded onto the grid, with a straight-through
        gradient. Its dtype is cast to ``x``'s.
      bits: The grid's bits (None: the default of :func:`bits_for`).
      name: What the run-time check's message calls this update (a layer).

    Returns:
      ``x + grid(d)``, on the grid.

    Raises:
      TypeError: If ``x`` is not float32 or float64.
      ValueError: If ``d`` does not broadcast to ``x``'s shape.

    Example:

    >>> import jax.numpy as jnp, revnet
    >>> x = revnet.exact.grid(jnp.array([1.0, 2.0]), bits=4)
    >>> revnet.exact.add(x, jnp.array([0.1, 0.2]), bits=4)
    Array([1.125 , 2.1875], dtype=float32)
    """
    x = jnp.asarray(x)
    bits = bits_for(x.dtype, bits, where=name)
    d = jnp.asarray(d)
    try:
        fits = jnp.broadcast_shapes(d.shape, x.shape) == x.shape
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(
            f"{name}: the increment's shape {d.shape} does not broadcast to the "
            f"stream's {x.shape}"
        )
    d = jnp.broadcast_to(d.astype(x.dtype), x.shape)
    return _add_fn(bits, name)(x, d)
