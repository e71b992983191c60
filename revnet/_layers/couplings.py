"""The coupling arithmetic of every front door, on plain callables.

A coupling splits the last axis of the stream into halves and adds (or scales
and shifts) one half by a function of the other: plain ``jnp`` code that the
core inverts equation by equation. The residual functions are given as plain
callables ``h -> (out, aux)``, where ``aux`` is whatever the framework threads
through (new BatchNorm state, or None); the front doors (Haiku's
``revnet.blocks``, ``revnet.eqx``, ``revnet.nnx``) lift their modules into such
callables, with explicit parameters, state and RNG keys, so that the very same
forward computation can be handed to :func:`revnet.inverse` (:func:`invert`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import revnet
from revnet._checks import check_bool, check_choice, check_int, check_real
from revnet._layers.checks import check_output, check_splittable

Residual = Callable[[jax.Array], tuple[jax.Array, Any]]
"""A residual function ``h -> (out, aux)``."""

EXPECTED = {
    0: "[..., 2 * half_channels]",
    1: "[batch, ..., 2 * half_channels]",
}
"""The stream's shape, for error messages, by the number of batch axes."""


def check_stream(name: str, x: Any, batch_dims: int) -> int:
    """Checks that ``x`` is a floating point stream (``batch_dims`` leading
    batch axes, then at least one more) whose last axis splits into halves;
    returns the half."""
    return check_splittable(name, x, EXPECTED[batch_dims], min_rank=batch_dims + 1)


SCALES = ("sigmoid", "tanh", "exp")
"""The affine coupling's scale functions (see :func:`scale`)."""


def check_scale(where: str, scale: Any, scale_bound: Any) -> tuple[str, float | None]:
    """Checks an affine coupling's ``scale`` and ``scale_bound``.

    Returns:
      ``(scale, scale_bound)``; ``scale_bound`` is 2.0 for ``"tanh"`` when left
      out, and None for the other scales.

    Raises:
      TypeError: If ``scale`` is not a string or ``scale_bound`` not a number.
      ValueError: If ``scale`` is not one of :data:`SCALES`, or ``scale_bound``
        is not positive and finite, or is given with another scale.
    """
    scale = check_choice(where, "scale", scale, SCALES)
    if scale_bound is None:
        return scale, (2.0 if scale == "tanh" else None)
    scale_bound = check_real(
        where,
        "scale_bound",
        scale_bound,
        "a positive finite number or None",
        low=0.0,
        low_inclusive=False,
    )
    if scale != "tanh":
        raise ValueError(
            f"{where}: scale_bound must be None unless scale='tanh' (it bounds "
            f"that log-scale), got {scale_bound} with scale={scale!r}."
        )
    return scale, scale_bound


def check_exact(where: str, exact: Any, exact_bits: Any) -> tuple[bool, int | None]:
    """Checks an additive coupling's ``exact`` and ``exact_bits``.

    Returns:
      ``(exact, exact_bits)``; ``exact_bits`` None is the default grid of
      :func:`revnet.exact.bits_for`, resolved from the stream's dtype.

    Raises:
      TypeError: If ``exact`` is not a bool or ``exact_bits`` not an integer.
      ValueError: If ``exact_bits`` is negative, or given without ``exact``.
    """
    exact = check_bool(where, "exact", exact)
    if exact_bits is None:
        return exact, None
    exact_bits = check_int(where, "exact_bits", exact_bits, minimum=0)
    if not exact:
        raise ValueError(
            f"{where}: exact_bits={exact_bits} applies only with exact=True (it "
            "sets the grid of the exact mode)"
        )
    return exact, exact_bits


def refuse_exact(where: str, exact: Any) -> None:
    """An affine coupling's ``exact``: False, or refused.

    A product of two values on a grid needs more bits than the grid holds, so
    ``x2 * a`` rounded back onto it loses bits that only a buffer growing with
    depth could keep (MacKay et al.'s reversible RNNs); revnet does not offer
    that, and refuses rather than rebuild inexactly.

    Raises:
      TypeError: If ``exact`` is not a bool.
      ValueError: If ``exact`` is True.
    """
    if check_bool(where, "exact", exact):
        raise ValueError(
            f"{where}: exact=True is refused: an affine coupling multiplies the "
            "stream, and a product of values on the grid needs more bits than "
            "the grid holds, so its inverse cannot be exact without storing the "
            "lost bits at every layer; use AdditiveCoupling(f, g, exact=True)"
        )


def split_halves(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Splits the last axis of ``x`` into two equal halves.

    One ``split`` rather than two slices: its inverse and its VJP are one
    concatenation, where the slices' VJPs are a sum of two pads, which XLA
    schedules worse in unrolled chains of blocks (memory that grows with depth).
    """
    a, b = jnp.split(x, 2, axis=-1)
    return a, b


def join_halves(a: jax.Array, b: jax.Array) -> jax.Array:
    """Concatenates two halves along the last axis."""
    return jnp.concatenate([a, b], axis=-1)


def scale(
    raw: jax.Array, kind: str, bound: float | None
) -> tuple[jax.Array, jax.Array]:
    """The affine coupling's scale ``a(raw)`` and its logarithm.

    Args:
      raw: The net's raw scale output.
      kind: ``"sigmoid"`` (``a = 1/2 + sigmoid(raw)``), ``"tanh"`` (``log a =
        bound * tanh(raw / bound)``) or ``"exp"`` (``log a = raw``).
      bound: The log-scale's bound with ``"tanh"``; ignored otherwise.

    Returns:
      ``(a, log_a)``.
    """
    if kind == "sigmoid":
        a = 0.5 + jax.nn.sigmoid(raw)
        return a, jnp.log(a)
    log_a = bound * jnp.tanh(raw / bound) if kind == "tanh" else raw
    return jnp.exp(log_a), log_a


def additive(
    f: Residual,
    g: Residual,
    x: jax.Array,
    *,
    batch_dims: int = 1,
    name: str = "additive coupling",
    exact: bool = False,
    exact_bits: int | None = None,
) -> tuple[jax.Array, tuple[Any, Any]]:
    """The additive coupling ``y1 = x1 + f(x2)``, ``y2 = x2 + g(y1)``.

    With ``exact``, the input is rounded onto the grid ``2**-exact_bits`` and
    each increment too (:mod:`revnet.exact`), so that the inverse rebuilds
    the input bit for bit.

    Args:
      f: Residual function of ``x2``, returning ``(out, aux)`` with ``out``
        shaped like ``x1``.
      g: Residual function of ``y1``, returning ``(out, aux)`` with ``out``
        shaped like ``x2``.
      x: The stream, ``[batch, ..., 2 * half_channels]``.
      batch_dims: The number of leading batch axes of ``x``: 1, or 0 for one
        example (a front door that vmaps its blocks over the batch).
      name: The module, for error messages.
      exact: Whether to run on the grid (see above).
      exact_bits: The grid's bits; None: the default for the stream's dtype.

    Returns:
      ``(y, (aux_f, aux_g))``.

    Raises:
      ValueError: If the last axis of ``x`` is odd, or ``f`` or ``g`` returns
        the wrong shape.
      TypeError: If ``exact`` and the stream is not float32 or float64.

    Example:

    >>> f = lambda h: (jnp.tanh(h), None)
    >>> y, _ = additive(f, f, jnp.ones([2, 4]))
    >>> y.shape
    (2, 4)
    """
    check_stream(name, x, batch_dims)
    if exact:
        bits = revnet.exact.bits_for(x.dtype, exact_bits, where=name)
        x = revnet.exact.grid(x, bits=bits)

        def add(a, d):
            return revnet.exact.add(a, d, bits=bits, name=name)

    else:

        def add(a, d):
            return a + d

    x1, x2 = split_halves(x)
    fx, aux_f = f(x2)
    check_output(name, "f", fx, x1.shape)
    y1 = add(x1, fx)
    gy, aux_g = g(y1)
    check_output(name, "g", gy, x2.shape)
    return join_halves(y1, add(x2, gy)), (aux_f, aux_g)


def affine(
    net: Residual,
    x: jax.Array,
    *,
    scale_kind: str = "sigmoid",
    scale_bound: float | None = None,
    batch_dims: int = 1,
    name: str = "affine coupling",
) -> tuple[tuple[jax.Array, jax.Array], Any]:
    """The affine coupling ``y = (x1, x2 * a(r) + t)`` with ``(r, t) = net(x1)``.

    Args:
      net: Function of ``x1`` returning ``(out, aux)`` with ``out`` of shape
        ``[..., 2 * half_channels]`` (raw scale, then shift).
      x: The stream, ``[batch, ..., 2 * half_channels]``.
      scale_kind: One of :data:`SCALES` (see :func:`scale`).
      scale_bound: The log-scale's bound with ``"tanh"``.
      batch_dims: The number of leading batch axes of ``x`` (1, or 0 for one
        example).
      name: The module, for error messages.

    Returns:
      ``((y, log_det), aux)`` where ``log_det``, shaped like the batch axes
      (``[batch]``, or a scalar for one example), is the sum of the log-scales
      per example.

    Raises:
      ValueError: If the last axis of ``x`` is odd, or ``net`` returns the
        wrong shape.

    Example:

    >>> net = lambda h: (jnp.zeros(h.shape[:-1] + (4,)), None)
    >>> (y, log_det), _ = affine(net, jnp.ones([2, 4]))
    >>> log_det.shape
    (2,)
    """
    check_stream(name, x, batch_dims)
    x1, x2 = split_halves(x)
    out, aux = net(x1)
    check_output(name, "net", out, x1.shape[:-1] + (2 * x2.shape[-1],))
    raw, t = split_halves(out)
    a, log_a = scale(raw, scale_kind, scale_bound)
    log_det = jnp.sum(log_a.reshape(log_a.shape[:batch_dims] + (-1,)), axis=-1)
    return (join_halves(x1, x2 * a + t), log_det), aux


def invert(forward: Callable[[jax.Array], jax.Array], y: jax.Array) -> jax.Array:
    """Runs the shape-preserving pure function ``forward`` backwards from ``y``.

    Example:

    >>> f = lambda h: (jnp.tanh(h), None)
    >>> x = jnp.ones([2, 4])
    >>> y, _ = additive(f, f, x)
    >>> bool(jnp.allclose(invert(lambda h: additive(f, f, h)[0], y), x))
    True
    """
    (x,) = revnet.inverse(forward, y)(y)
    return x
