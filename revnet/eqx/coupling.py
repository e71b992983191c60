"""Equinox couplings: the additive (RevNet) and affine (RealNVP) blocks.

Each is an ``eqx.Module`` holding its residual functions (Equinox modules)
around the coupling arithmetic all front doors share (``revnet/_layers/couplings.py``).
Like ``eqx.nn.Linear`` they act on ONE example, ``[..., 2 * half]``, split on
its last axis; ``jax.vmap`` them, or stack them in a
:class:`~revnet.eqx.ReversibleSequence`, which does. A residual function
holding state (``eqx.nn.BatchNorm``) is called as ``f(h, state, key=key)``,
any other as ``f(h, key=key)``.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax

from revnet._checks import check_callable
from revnet._layers import couplings
from revnet._layers.precision import coupling_compute_dtype
from revnet.eqx._call import call_in, split_key


def _updated(state: eqx.nn.State | None, *subs: Any) -> eqx.nn.State | None:
    for sub in subs:
        if sub is not None:
            state = state.update(sub)
    return state


class AdditiveCoupling(eqx.Module):
    """Additive coupling: ``y1 = x1 + f(x2)``, ``y2 = x2 + g(y1)``.

    Its inverse is ``x2 = y2 - g(y1)``, ``x1 = y1 - f(x2)``.

    Example:

    >>> kf, kg = jax.random.split(jax.random.key(0))
    >>> block = AdditiveCoupling(
    ...     eqx.nn.MLP(2, 2, 16, 1, key=kf), eqx.nn.MLP(2, 2, 16, 1, key=kg)
    ... )
    >>> x = jnp.ones(4)
    >>> y = block(x)
    >>> bool(jnp.allclose(block.inverse(y), x, atol=1e-6))
    True
    """

    f: Any
    g: Any
    compute_dtype: Any = eqx.field(static=True)
    exact: bool = eqx.field(static=True)
    exact_bits: int | None = eqx.field(static=True)

    def __init__(
        self,
        f: Any,
        g: Any,
        *,
        compute_dtype: Any = None,
        exact: bool = False,
        exact_bits: int | None = None,
    ):
        """Constructs the coupling.

        Args:
          f: Equinox module (or callable ``f(h, *, key)``) applied to ``x2``,
            returning an array shaped like ``x1``.
          g: Equinox module applied to ``y1``, returning an array shaped like
            ``x2``.
          compute_dtype: None, or a floating point dtype (e.g.
            ``jnp.bfloat16``) in which ``f`` and ``g`` compute: their inputs
            and floating point arrays are cast to it and their outputs back,
            while the arrays, the state and the stream keep their dtype. Left
            out inside a :class:`~revnet.eqx.ReversibleSequence` with a
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
        where = "AdditiveCoupling"
        self.f = check_callable(where, "f", f)
        self.g = check_callable(where, "g", g)
        self.compute_dtype = coupling_compute_dtype(where, compute_dtype)
        self.exact, self.exact_bits = couplings.check_exact(where, exact, exact_bits)

    def _forward(self, state, key):
        kf, kg = split_key(key, 2)
        name, dtype = "AdditiveCoupling", self.compute_dtype

        def forward(h):
            return couplings.additive(
                lambda u: call_in(dtype, name, "f", self.f, u, state, kf),
                lambda u: call_in(dtype, name, "g", self.g, u, state, kg),
                h,
                batch_dims=0,
                name=name,
                exact=self.exact,
                exact_bits=self.exact_bits,
            )

        return forward

    def __call__(
        self,
        x: jax.Array,
        state: eqx.nn.State | None = None,
        *,
        key: jax.Array | None = None,
    ) -> jax.Array | tuple[jax.Array, eqx.nn.State]:
        """Applies the coupling to one example ``x``; returns ``y``, or ``(y,
        state)`` when given ``state``."""
        y, subs = self._forward(state, key)(x)
        return y if state is None else (y, _updated(state, *subs))

    def inverse(
        self,
        y: jax.Array,
        state: eqx.nn.State | None = None,
        *,
        key: jax.Array | None = None,
    ) -> jax.Array:
        """Rebuilds the input from the output ``y``.

        Args:
          y: Output of this coupling for one example.
          state: The state the call was given (read, not updated).
          key: The key the call was given, to replay dropout.

        Returns:
          The input ``x`` with ``self(x) == y`` (up to rounding).

        Raises:
          ValueError: If the last axis of ``y`` is odd.
          revnet.NotInvertibleError: If ``f`` or ``g`` cannot be run as needed.
        """
        forward = self._forward(state, key)
        return couplings.invert(lambda h: forward(h)[0], y)


class AffineCoupling(eqx.Module):
    """Affine coupling: ``y = (x1, x2 * a(r) + t)`` with ``(r, t) = net(x1)``.

    The scale ``a`` is ``1/2 + sigmoid(r)`` (``scale="sigmoid"``, the default,
    in ``(1/2, 3/2)``), ``exp(b * tanh(r / b))`` (``"tanh"``, ``b =
    scale_bound``, default 2) or ``exp(r)`` (``"exp"``); see
    :class:`revnet.blocks.AffineCoupling` for their conditioning. Initialise
    ``net``'s output layer to zero to start at the identity.

    Example:

    >>> block = AffineCoupling(eqx.nn.MLP(2, 4, 16, 1, key=jax.random.key(0)))
    >>> y, log_det = block.forward_and_log_det(jnp.ones(4))
    >>> y.shape, log_det.shape
    ((4,), ())
    """

    net: Any
    scale: str = eqx.field(static=True)
    scale_bound: float | None = eqx.field(static=True)
    compute_dtype: Any = eqx.field(static=True)

    def __init__(
        self,
        net: Any,
        *,
        scale: str = "sigmoid",
        scale_bound: float | None = None,
        compute_dtype: Any = None,
        exact: bool = False,
    ):
        """Constructs the coupling.

        Args:
          net: Equinox module of ``x1`` returning ``[..., 2 * half]`` (raw scale,
            then shift).
          scale: ``"sigmoid"``, ``"tanh"`` or ``"exp"``.
          scale_bound: With ``scale="tanh"``, the log-scale's bound (default
            2.0); give it with ``"tanh"`` only.
          compute_dtype: None, or a floating point dtype in which ``net``
            computes (see :class:`AdditiveCoupling`); the scale, the shift and
            the log-determinant are applied in the stream's dtype.
          exact: Refused when True: an affine coupling multiplies the stream,
            and its inverse cannot be exact (see :mod:`revnet.exact`); use
            ``AdditiveCoupling(f, g, exact=True)``.

        Raises:
          TypeError: If ``net`` is not callable, ``scale`` not a string,
            ``scale_bound`` not a number, ``compute_dtype`` not None or a
            floating point dtype, or ``exact`` not a bool.
          ValueError: If ``scale`` is not one of the three, or ``scale_bound``
            is not positive or given with another scale, or ``exact`` is True.
        """
        name = "AffineCoupling"
        self.net = check_callable(name, "net", net)
        couplings.refuse_exact(name, exact)
        self.scale, scale_bound = couplings.check_scale(name, scale, scale_bound)
        self.scale_bound = scale_bound
        self.compute_dtype = coupling_compute_dtype(name, compute_dtype)

    def _forward(self, state, key):
        name, dtype = "AffineCoupling", self.compute_dtype

        def forward(h):
            return couplings.affine(
                lambda u: call_in(dtype, name, "net", self.net, u, state, key),
                h,
                scale_kind=self.scale,
                scale_bound=self.scale_bound,
                batch_dims=0,
                name=name,
            )

        return forward

    def forward_and_log_det(
        self,
        x: jax.Array,
        state: eqx.nn.State | None = None,
        *,
        key: jax.Array | None = None,
    ) -> Any:
        """Applies the coupling to one example and returns ``log|det dy/dx|``.

        Args:
          x: One example, ``[..., 2 * half]``.
          state: The model's state, if ``net`` holds any.
          key: RNG key for ``net`` (dropout).

        Returns:
          ``(y, log_det)`` (``log_det`` a scalar), or ``((y, log_det), state)``
          when given ``state``.

        Raises:
          ValueError: If the last axis of ``x`` is odd or ``net`` returns the
            wrong shape.
        """
        out, sub = self._forward(state, key)(x)
        return out if state is None else (out, _updated(state, sub))

    def __call__(
        self,
        x: jax.Array,
        state: eqx.nn.State | None = None,
        *,
        key: jax.Array | None = None,
    ) -> jax.Array | tuple[jax.Array, eqx.nn.State]:
        """Applies the coupling to one example; ``y``, or ``(y, state)``."""
        (y, _), sub = self._forward(state, key)(x)
        return y if state is None else (y, _updated(state, sub))

    def inverse(
        self,
        y: jax.Array,
        state: eqx.nn.State | None = None,
        *,
        key: jax.Array | None = None,
    ) -> jax.Array:
        """Rebuilds the input from the output ``y`` (same state and key).

        Args:
          y: Output of this coupling for one example.
          state: The state the call was given (read, not updated).
          key: The key the call was given.

        Returns:
          The input ``x`` with ``self(x) == y`` (up to rounding).

        Raises:
          ValueError: If the last axis of ``y`` is odd.
        """
        forward = self._forward(state, key)
        return couplings.invert(lambda h: forward(h)[0][0], y)
