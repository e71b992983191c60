"""Coupling layers as NNX modules holding their residual submodules.

The arithmetic is the framework-free one of :mod:`revnet._layers.couplings`; the
residual functions are the submodules themselves, called in place. Inside a
:class:`~revnet.nnx.ReversibleSequence` the core inverts a coupling like any
other code; on its own, a coupling differentiates like any NNX module, and
:meth:`inverse` lifts it into a pure function (``_lift.py``) for
:func:`revnet.inverse`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from revnet._checks import check_callable
from revnet._layers import couplings
from revnet._layers.precision import coupling_compute_dtype
from revnet.nnx import _lift

Residual = Callable[[jax.Array], jax.Array]


def _inverse(where: str, module: nnx.Module, y: jax.Array) -> jax.Array:
    """Runs ``module``'s ``__call__`` backwards from ``y``, reading its state."""
    graphdef, params, state = _lift.split(where, module)
    apply = _lift.pure(graphdef)

    def forward(h):
        return apply(params, state, h)[0]

    forward.__name__ = where
    return couplings.invert(forward, y)


class AdditiveCoupling(nnx.Module):
    """Additive coupling, the RevNet block: ``y1 = x1 + f(x2)``, ``y2 = x2 + g(y1)``.

    The last axis of ``x`` is split into halves ``x1, x2``; the inverse is
    ``x2 = y2 - g(y1)``, ``x1 = y1 - f(x2)``.

    Example:

    >>> rngs = nnx.Rngs(0)
    >>> coupling = AdditiveCoupling(
    ...     nnx.Linear(4, 4, rngs=rngs), nnx.Linear(4, 4, rngs=rngs))
    >>> x = jnp.ones([2, 8])
    >>> bool(jnp.allclose(coupling.inverse(coupling(x)), x, atol=1e-6))
    True
    """

    def __init__(
        self,
        f: Residual,
        g: Residual,
        *,
        compute_dtype: Any = None,
        exact: bool = False,
        exact_bits: int | None = None,
    ):
        """Constructs the coupling.

        Args:
          f: Residual function of ``x2`` returning an array shaped like
            ``x1``: an ``nnx.Module`` (such as ``nnx.Sequential`` of a
            ``nnx.Linear``, a ``nnx.BatchNorm`` and a ``nnx.Dropout``) or a
            plain function.
          g: Residual function of ``y1`` returning an array shaped like ``x2``.
          compute_dtype: None, or a floating point dtype (e.g.
            ``jnp.bfloat16``) in which ``f`` and ``g`` compute: their inputs
            and parameters are cast to it and their outputs back, while the
            parameters, the statistics and the stream keep their dtype. Left
            out inside a :class:`~revnet.nnx.ReversibleSequence` with a
            ``compute_dtype``, the sequence's is used.
          exact: If True, the stream runs on a fixed-point grid and the
            inverse rebuilds it bit for bit at any depth (:mod:`revnet.exact`):
            the input is rounded onto the grid, and so is each increment, with
            a straight-through gradient. Needs a float32 or float64 stream.
          exact_bits: With ``exact``, the grid ``2**-exact_bits``; None: the
            default (10 in float32, 39 in float64), which keeps ``|x| < 16384``
            exact.

        Raises:
          TypeError: If ``f`` or ``g`` is not callable, ``compute_dtype`` is
            not None or a floating point dtype, ``exact`` is not a bool or
            ``exact_bits`` not an integer.
          ValueError: If ``exact_bits`` is negative or given without ``exact``.
        """
        where = type(self).__name__
        self.f = check_callable(where, "f", f)
        self.g = check_callable(where, "g", g)
        self.compute_dtype = coupling_compute_dtype(where, compute_dtype)
        self.exact, self.exact_bits = couplings.check_exact(where, exact, exact_bits)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Applies the coupling to ``x`` of shape ``[batch, ..., channels]``."""
        f = _lift.in_dtype(self.f, self.compute_dtype)
        g = _lift.in_dtype(self.g, self.compute_dtype)
        y, _ = couplings.additive(
            lambda h: (f(h), None),
            lambda h: (g(h), None),
            x,
            name=type(self).__name__,
            exact=self.exact,
            exact_bits=self.exact_bits,
        )
        return y

    def inverse(self, y: jax.Array) -> jax.Array:
        """Rebuilds the input from the output ``y``, reading the current state.

        Args:
          y: Output of this coupling, of shape ``[batch, ..., channels]``.

        Returns:
          The input ``x`` with ``self(x) == y`` (with the dropout streams as
          they were before that call: ``nnx.clone`` the module before a
          training-mode call to replay its masks).

        Raises:
          ValueError: If the last axis of ``y`` is odd or ``y`` has rank < 2.
          TypeError: If ``y`` is not floating point.
        """
        return _inverse(type(self).__name__, self, y)


class AffineCoupling(nnx.Module):
    """Affine coupling (RealNVP / Glow): ``y = (x1, x2 * a(r) + t)``.

    ``net(x1)`` returns ``[..., 2 * half_channels]``, split into a raw scale
    ``r`` and a shift ``t``. The scale ``a(r)`` is ``1/2 + sigmoid(r)`` with
    ``scale="sigmoid"`` (default, in ``(1/2, 3/2)``), ``exp(b * tanh(r / b))``
    with ``scale="tanh"`` (``b = scale_bound``, default 2) or ``exp(r)`` with
    ``scale="exp"`` (unbounded); see :class:`revnet.blocks.AffineCoupling` for
    the conditioning of each. Initialise the net's output layer to zeros
    (``kernel_init=nnx.initializers.zeros``) to start at the identity.

    Example:

    >>> net = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    >>> y, log_det = AffineCoupling(net).forward_and_log_det(jnp.ones([2, 8]))
    >>> y.shape, log_det.shape
    ((2, 8), (2,))
    """

    def __init__(
        self,
        net: Residual,
        *,
        scale: str = "sigmoid",
        scale_bound: float | None = None,
        compute_dtype: Any = None,
        exact: bool = False,
    ):
        """Constructs the coupling.

        Args:
          net: Function of ``x1`` returning ``[..., 2 * half_channels]`` (raw
            scale, then shift): an ``nnx.Module`` or a plain function.
          scale: ``"sigmoid"``, ``"tanh"`` or ``"exp"``.
          scale_bound: With ``scale="tanh"``, the bound of the log-scale
            (default 2.0); give it with ``"tanh"`` only.
          compute_dtype: None, or a floating point dtype in which ``net``
            computes (see :class:`AdditiveCoupling`); the scale, the shift
            and the log-determinant are applied in the stream's dtype.
          exact: Refused when True: an affine coupling multiplies the stream,
            and its inverse cannot be exact (see :mod:`revnet.exact`); use
            ``AdditiveCoupling(f, g, exact=True)``.

        Raises:
          TypeError: If ``net`` is not callable, ``scale`` not a string,
            ``scale_bound`` not a number or None, ``compute_dtype`` not
            None or a floating point dtype, or ``exact`` not a bool.
          ValueError: If ``scale`` is not one of the three, or ``scale_bound``
            is not positive and finite, or is given with another scale, or
            ``exact`` is True.
        """
        where = type(self).__name__
        self.net = check_callable(where, "net", net)
        couplings.refuse_exact(where, exact)
        self.scale, scale_bound = couplings.check_scale(where, scale, scale_bound)
        self.scale_bound = scale_bound
        self.compute_dtype = coupling_compute_dtype(where, compute_dtype)

    def forward_and_log_det(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Applies the coupling and returns ``log|det dy/dx|`` per example.

        Args:
          x: Input of shape ``[batch, ..., channels]``.

        Returns:
          ``(y, log_det)``, ``log_det`` of shape ``[batch]``.

        Raises:
          ValueError: If the last axis of ``x`` is odd, ``x`` has rank < 2 or
            ``net`` returns the wrong shape.
          TypeError: If ``x`` is not floating point.
        """
        net = _lift.in_dtype(self.net, self.compute_dtype)
        (y, log_det), _ = couplings.affine(
            lambda h: (net(h), None),
            x,
            scale_kind=self.scale,
            scale_bound=self.scale_bound,
            name=type(self).__name__,
        )
        return y, log_det

    def __call__(self, x: jax.Array) -> jax.Array:
        """Applies the coupling to ``x`` of shape ``[batch, ..., channels]``."""
        return self.forward_and_log_det(x)[0]

    def inverse(self, y: jax.Array) -> jax.Array:
        """Rebuilds the input from the output ``y``, reading the current state.

        Args:
          y: Output of this coupling, of shape ``[batch, ..., channels]``.

        Returns:
          The input ``x`` with ``self(x) == y``.

        Raises:
          ValueError: If the last axis of ``y`` is odd or ``y`` has rank < 2.
          TypeError: If ``y`` is not floating point.
        """
        return _inverse(type(self).__name__, self, y)
