"""Coupling layers: the invertible building blocks of reversible networks.

Both couplings split the last axis into two halves and are plain ``jnp`` code
around their residual functions (the arithmetic every front door shares, in
``revnet/_layers/couplings.py``). The residual functions are ordinary Haiku code,
lifted into pure functions of explicit parameters, state and RNG keys
(see ``_lift.py``), so that the couplings' :meth:`inverse` methods can hand the
very same forward computation to :func:`revnet.inverse`. Inside a
:class:`~revnet.blocks.ReversibleSequence` the core inverts a coupling like any
other code; applied on their own, the couplings differentiate like any Haiku
module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import haiku as hk
import jax

from revnet._checks import (
    check_bool,
    check_callable,
)
from revnet._layers import couplings
from revnet._layers.checks import check_splittable
from revnet._layers.precision import coupling_compute_dtype
from revnet.blocks._lift import Lifted
from revnet.blocks._names import check_name

_EXPECTED = couplings.EXPECTED[1]


def rng_keys(num: int) -> tuple[jax.Array | None, ...]:
    """Draws one key from Haiku's sequence and splits it into ``num`` keys.

    Drawing a fixed number of keys in a fixed order, whatever the order in which
    the residual functions later run, is what lets an inverse replay dropout.
    """
    key = hk.maybe_next_rng_key()
    if key is None:
        return (None,) * num
    return tuple(jax.random.split(key, num))


class AdditiveCoupling(hk.Module):
    """Additive coupling, the RevNet block.

    Splits the last axis of ``x`` into halves ``x1, x2`` and computes
    ``y1 = x1 + f(x2)``, ``y2 = x2 + g(y1)``. Its inverse is
    ``x2 = y2 - g(y1)``, ``x1 = y1 - f(x2)``.

    Example:

    >>> def block(x):
    ...   f = lambda h: hk.nets.MLP([16, 4])(h)
    ...   g = lambda h: hk.nets.MLP([16, 4])(h)
    ...   return AdditiveCoupling(f, g)(x)
    >>> model = hk.transform(block)
    >>> x = jnp.ones([2, 8])
    >>> params = model.init(jax.random.PRNGKey(0), x)
    >>> model.apply(params, None, x).shape
    (2, 8)
    """

    def __init__(
        self,
        f: Callable[[jax.Array], jax.Array],
        g: Callable[[jax.Array], jax.Array],
        compute_dtype: Any = None,
        name: str | None = None,
        *,
        exact: bool = False,
        exact_bits: int | None = None,
    ):
        """Constructs the coupling.

        Args:
          f: Residual function applied to ``x2``. It builds and applies Haiku
            modules when called (e.g. ``lambda h: hk.nets.MLP([64, 32])(h)``), or
            is a plain function, and returns an array shaped like ``x1``. Its
            parameters live under ``<name>/~/f``.
          g: Residual function applied to ``y1``, returning an array shaped like
            ``x2``. Its parameters live under ``<name>/~/g``.
          compute_dtype: Optional dtype (e.g. ``jnp.bfloat16``) in which ``f`` and
            ``g`` compute; parameters and the residual stream keep their dtype.
            Left out inside a ``ReversibleSequence`` with a ``compute_dtype``,
            the sequence's is used.
          name: Name of the module.
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
        check_name(type(self), name)
        super().__init__(name=name)
        module = self.module_name
        check_callable(module, "f", f)
        check_callable(module, "g", g)
        compute_dtype = coupling_compute_dtype(module, compute_dtype)
        self.exact, self.exact_bits = couplings.check_exact(module, exact, exact_bits)
        self._f = Lifted(f, self, "f", compute_dtype)
        self._g = Lifted(g, self, "g", compute_dtype)

    def _forward(self, x: Any) -> Callable[[jax.Array], tuple[jax.Array, Any]]:
        """Fetches (or creates) the parameters, state and keys; returns the pure
        coupling ``h -> (y, (new_state_f, new_state_g))``."""
        module = self.module_name
        half = check_splittable(module, x, _EXPECTED)
        # At init, g is created from x1, which has the shape of y1.
        x1 = x[..., :half] if hk.running_init() else None
        x2 = x[..., half:] if hk.running_init() else None
        pf, sf = self._f.params_and_state(x2)
        pg, sg = self._g.params_and_state(x1)
        kf, kg = rng_keys(2)
        f, g = self._f.apply, self._g.apply
        exact, bits = self.exact, self.exact_bits

        def additive_coupling(h):
            return couplings.additive(
                lambda u: f(pf, sf, kf, u),
                lambda u: g(pg, sg, kg, u),
                h,
                name=module,
                exact=exact,
                exact_bits=bits,
            )

        return additive_coupling

    def __call__(self, x: jax.Array) -> jax.Array:
        """Applies the coupling to ``x`` of shape ``[batch, ..., channels]``."""
        y, (state_f, state_g) = self._forward(x)(x)
        self._f.update_state(state_f)
        self._g.update_state(state_g)
        return y

    def inverse(self, y: jax.Array) -> jax.Array:
        """Rebuilds the input from the output ``y`` (same RNG key as the call).

        Args:
          y: Output of this coupling, of shape ``[batch, ..., channels]``.

        Returns:
          The input ``x`` with ``self(x) == y``. State is read, not updated.

        Raises:
          ValueError: If the last axis of ``y`` is odd or ``y`` has rank < 2.
          TypeError: If ``y`` is not floating point.
        """
        forward = self._forward(y)
        return couplings.invert(lambda h: forward(h)[0], y)


class AffineCoupling(hk.Module):
    """Affine coupling (as in RealNVP / Glow), well conditioned by default.

    Splits the last axis of ``x`` into halves ``x1, x2``; ``net(x1)`` returns an
    array whose last axis is twice that of ``x2``, split into a raw scale ``r``
    and a shift ``t``, and ``y = (x1, x2 * a(r) + t)``. The scale ``a(r)``:

    * ``scale="sigmoid"`` (default): ``a = 1/2 + sigmoid(r)``, in ``(1/2, 3/2)``
      and 1 at ``r = 0``. With ``zero_init`` (default) the net's output layer
      starts at zero, so each block starts as the identity.
    * ``scale="tanh"``: ``a = exp(b * tanh(r / b))`` with ``b = scale_bound``,
      a soft clamp of the log-scale to ``(-b, b)``.
    * ``scale="exp"``: ``a = exp(r)``, unbounded.

    Conditioning, per block. For fixed ``x1`` the map ``x2 -> y2`` has
    Lipschitz constant ``max a`` and its inverse ``1 / min a``: 3/2 and 2 for
    ``"sigmoid"``, ``e^b`` both ways for ``"tanh"``, unbounded for ``"exp"``.
    Through ``x1`` the block also depends on the net: if ``L_r`` and ``L_t``
    are the Lipschitz constants of its raw-scale and shift outputs and
    ``|x2| <= m`` elementwise, the Jacobian's off-diagonal block is at most
    ``A = m * c * L_r + L_t`` in norm (``c = max |a'|``: 1/4 for
    ``"sigmoid"``, ``e^b`` for ``"tanh"``), so the forward map is Lipschitz
    with constant at most ``max a + A`` and the inverse at most ``(1 + A) /
    min a``: ``3/2 + A`` and ``2 (1 + A)`` for the default. A bounded scale
    whose range lies mostly below 1 keeps ``m`` from growing with depth;
    ``python -m experiments.numerics`` measures the reconstruction error of
    each scale at depth (docs/guides/numerics.md).

    Example:

    >>> def flow(x):
    ...   net = lambda h: hk.nets.MLP([16, 8])(h)
    ...   return AffineCoupling(net).forward_and_log_det(x)
    >>> model = hk.transform(flow)
    >>> x = jnp.ones([2, 8])
    >>> params = model.init(jax.random.PRNGKey(0), x)
    >>> y, log_det = model.apply(params, None, x)
    >>> y.shape, log_det.shape
    ((2, 8), (2,))
    """

    def __init__(
        self,
        net: Callable[[jax.Array], jax.Array],
        scale: str = "sigmoid",
        scale_bound: float | None = None,
        zero_init: bool = True,
        compute_dtype: Any = None,
        name: str | None = None,
        *,
        exact: bool = False,
    ):
        """Constructs the coupling.

        Args:
          net: Function of ``x1`` returning ``[..., 2 * half_channels]`` (raw
            scale, then shift). Builds and applies Haiku modules when called;
            its parameters live under ``<name>/~/net``.
          scale: ``"sigmoid"``, ``"tanh"`` or ``"exp"``: how the raw scale
            becomes the scale (see above).
          scale_bound: With ``scale="tanh"``, the bound ``b`` of the
            log-scale (default 2.0); give it with ``"tanh"`` only.
          zero_init: If True, the parameters of the module that ``net``
            creates last (its output layer) are initialised to zero, so the
            block starts as the identity (every scale has ``a(0) = 1``).
          compute_dtype: Optional dtype in which ``net`` computes; parameters and
            the residual stream keep their dtype.
          name: Name of the module.
          exact: Refused when True: an affine coupling multiplies the stream,
            and its inverse cannot be exact (see :mod:`revnet.exact`); use
            ``AdditiveCoupling(f, g, exact=True)``.

        Raises:
          TypeError: If ``net`` is not callable, ``scale`` is not a string,
            ``scale_bound`` is not a number or None, ``zero_init`` or
            ``exact`` is not a bool, or ``compute_dtype`` is not None or a
            floating point dtype.
          ValueError: If ``scale`` is not one of the three, ``scale_bound`` is
            not positive and finite, or is given with another scale, or
            ``exact`` is True.
        """
        check_name(type(self), name)
        super().__init__(name=name)
        module = self.module_name
        check_callable(module, "net", net)
        couplings.refuse_exact(module, exact)
        scale, scale_bound = couplings.check_scale(module, scale, scale_bound)
        zero_init = check_bool(module, "zero_init", zero_init)
        compute_dtype = coupling_compute_dtype(module, compute_dtype)
        self._net = Lifted(net, self, "net", compute_dtype, zero_last=zero_init)
        self.scale = scale
        self.scale_bound = scale_bound
        self.zero_init = zero_init

    def _forward(self, x: Any) -> Callable[[jax.Array], tuple[Any, Any]]:
        """Fetches (or creates) the parameters, state and key; returns the pure
        coupling ``h -> ((y, log_det), new_state)``."""
        module = self.module_name
        half = check_splittable(module, x, _EXPECTED)
        x1 = x[..., :half] if hk.running_init() else None
        params, state = self._net.params_and_state(x1)
        (key,) = rng_keys(1)
        net, kind, bound = self._net.apply, self.scale, self.scale_bound

        def affine_coupling(h):
            return couplings.affine(
                lambda u: net(params, state, key, u),
                h,
                scale_kind=kind,
                scale_bound=bound,
                name=module,
            )

        return affine_coupling

    def __call__(self, x: jax.Array) -> jax.Array:
        """Applies the coupling to ``x`` of shape ``[batch, ..., channels]``."""
        return self.forward_and_log_det(x)[0]

    def forward_and_log_det(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Applies the coupling and returns the log-determinant of its Jacobian.

        Args:
          x: Input of shape ``[batch, ..., channels]``.

        Returns:
          ``(y, log_det)`` where ``log_det`` of shape ``[batch]`` is, per example,
          ``log|det dy/dx|`` (the sum of the log-scales).

        Raises:
          ValueError: If the last axis of ``x`` is odd or ``x`` has rank < 2.
          TypeError: If ``x`` is not floating point.
        """
        (y, log_det), state = self._forward(x)(x)
        self._net.update_state(state)
        return y, log_det

    def inverse(self, y: jax.Array) -> jax.Array:
        """Rebuilds the input from the output ``y`` (same RNG key as the call).

        Args:
          y: Output of this coupling, of shape ``[batch, ..., channels]``.

        Returns:
          The input ``x`` with ``self(x) == y``. State is read, not updated.

        Raises:
          ValueError: If the last axis of ``y`` is odd or ``y`` has rank < 2.
          TypeError: If ``y`` is not floating point.
        """
        forward = self._forward(y)
        return couplings.invert(lambda h: forward(h)[0][0], y)
