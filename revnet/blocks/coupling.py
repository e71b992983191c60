"""Coupling layers: the invertible building blocks of reversible networks.

Both couplings split the last axis into two halves. Their residual functions
are ordinary Haiku code, lifted into pure functions (see ``_lift.py``), so that
a :class:`~revnet.blocks.ReversibleSequence` can rebuild each block's input from
its output and take the VJP of the very same evaluations in one fused pass.
Applied on their own, the couplings differentiate like any Haiku module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp

from revnet.blocks import _tape
from revnet.blocks._checks import (
    check_callable,
    check_float_dtype,
    check_name,
    check_output,
    check_real,
    check_splittable,
)
from revnet.blocks._lift import Lifted, PureApply

_EXPECTED = "[batch, ..., 2 * half_channels]"


def split_halves(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Splits the last axis of ``x`` into two equal halves."""
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]


def join_halves(a: jax.Array, b: jax.Array) -> jax.Array:
    """Concatenates two halves along the last axis."""
    return jnp.concatenate([a, b], axis=-1)


def rng_keys(num: int) -> tuple[jax.Array | None, ...]:
    """Draws one key from Haiku's sequence and splits it into ``num`` keys.

    Drawing a fixed number of keys in a fixed order, whatever the order in which
    the residual functions later run, is what lets an inverse replay dropout.
    """
    key = hk.maybe_next_rng_key()
    if key is None:
        return (None,) * num
    return tuple(jax.random.split(key, num))


def apply_rule(
    rule: _tape.Rule,
    params: Any,
    aux: Any,
    x: Any,
    lifted: tuple[Lifted, ...],
) -> Any:
    """Applies ``rule`` forward and writes back new state, or records a step."""
    if _tape.is_recording():
        return _tape.emit(rule, params, aux, x)
    y, new_state = rule.forward(params, aux, x)
    for fn, state in zip(lifted, new_state, strict=True):
        fn.update_state(state)
    return y


class AdditiveRule(NamedTuple):
    """Pure additive coupling ``y1 = x1 + f(x2)``, ``y2 = x2 + g(y1)``.

    ``params`` is ``(params_f, params_g)``, ``aux`` is
    ``(state_f, state_g, rng_f, rng_g)``.
    """

    f: PureApply
    g: PureApply
    name: str

    def forward(self, params, aux, x):
        (pf, pg), (sf, sg, kf, kg) = params, aux
        x1, x2 = split_halves(x)
        fx, sf = self.f(pf, sf, kf, x2)
        check_output(self.name, "f", fx, x1.shape)
        y1 = x1 + fx
        gy, sg = self.g(pg, sg, kg, y1)
        check_output(self.name, "g", gy, x2.shape)
        return join_halves(y1, x2 + gy), (sf, sg)

    def inverse(self, params, aux, y):
        (pf, pg), (sf, sg, kf, kg) = params, aux
        y1, y2 = split_halves(y)
        x2 = y2 - self.g(pg, sg, kg, y1)[0]
        x1 = y1 - self.f(pf, sf, kf, x2)[0]
        return join_halves(x1, x2)

    def backward(self, params, aux, y, dy):
        (pf, pg), (sf, sg, kf, kg) = params, aux
        y1, y2 = split_halves(y)
        dy1, dy2 = split_halves(dy)
        # The evaluation of g that rebuilds x2 is the one whose VJP is taken.
        gy, g_vjp = jax.vjp(lambda p, h: self.g(p, sg, kg, h)[0], pg, y1)
        x2 = y2 - gy
        dpg, dy1_from_g = g_vjp(dy2)
        dy1 = dy1 + dy1_from_g
        fx, f_vjp = jax.vjp(lambda p, h: self.f(p, sf, kf, h)[0], pf, x2)
        x1 = y1 - fx
        dpf, dx2_from_f = f_vjp(dy1)
        return join_halves(x1, x2), join_halves(dy1, dy2 + dx2_from_f), (dpf, dpg)


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
          name: Name of the module.

        Raises:
          TypeError: If ``f`` or ``g`` is not callable, or ``compute_dtype`` is
            not None or a floating point dtype.
        """
        check_name(type(self), name)
        super().__init__(name=name)
        module = self.module_name
        check_callable(module, "f", f)
        check_callable(module, "g", g)
        compute_dtype = check_float_dtype(module, "compute_dtype", compute_dtype)
        self._f = Lifted(f, self, "f", compute_dtype)
        self._g = Lifted(g, self, "g", compute_dtype)
        self._rule = AdditiveRule(self._f.apply, self._g.apply, self.module_name)

    def _params_and_aux(self, x: Any) -> tuple[Any, Any]:
        half = check_splittable(self.module_name, x, _EXPECTED)
        # At init, g is created from x1, which has the shape of y1.
        x1 = x[..., :half] if hk.running_init() else None
        x2 = x[..., half:] if hk.running_init() else None
        pf, sf = self._f.params_and_state(x2)
        pg, sg = self._g.params_and_state(x1)
        return (pf, pg), (sf, sg, *rng_keys(2))

    def __call__(self, x: jax.Array) -> jax.Array:
        """Applies the coupling to ``x`` of shape ``[batch, ..., channels]``."""
        params, aux = self._params_and_aux(x)
        return apply_rule(self._rule, params, aux, x, (self._f, self._g))

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
        params, aux = self._params_and_aux(y)
        return self._rule.inverse(params, aux, y)


class AffineRule(NamedTuple):
    """Pure affine coupling ``y1 = x1``, ``y2 = x2 * exp(s(x1)) + t(x1)``.

    ``params`` is the net's parameters, ``aux`` is ``(state, rng)``.
    """

    net: PureApply
    scale_bound: float | None
    name: str

    def scale_and_shift(self, params, aux, x1, half):
        """Returns ``((s, t), new_state)`` with ``s`` softly bounded."""
        state, key = aux
        h, state = self.net(params, state, key, x1)
        check_output(self.name, "net", h, x1.shape[:-1] + (2 * half,))
        raw, t = split_halves(h)
        if self.scale_bound is None:
            return (raw, t), state
        bound = self.scale_bound
        return (bound * jnp.tanh(raw / bound), t), state

    def forward_and_log_det(self, params, aux, x):
        """Returns ``(y, new_state, log_det)``; ``log_det`` has shape ``[batch]``."""
        x1, x2 = split_halves(x)
        (s, t), state = self.scale_and_shift(params, aux, x1, x2.shape[-1])
        log_det = jnp.sum(s.reshape(s.shape[0], -1), axis=-1)
        return join_halves(x1, x2 * jnp.exp(s) + t), state, log_det

    def forward(self, params, aux, x):
        y, state, _ = self.forward_and_log_det(params, aux, x)
        return y, (state,)

    def inverse(self, params, aux, y):
        y1, y2 = split_halves(y)
        (s, t), _ = self.scale_and_shift(params, aux, y1, y2.shape[-1])
        return join_halves(y1, (y2 - t) * jnp.exp(-s))

    def backward(self, params, aux, y, dy):
        y1, y2 = split_halves(y)
        dy1, dy2 = split_halves(dy)
        half = y2.shape[-1]
        (s, t), st_vjp = jax.vjp(
            lambda p, h: self.scale_and_shift(p, aux, h, half)[0], params, y1
        )
        scale = jnp.exp(s)
        shifted = y2 - t  # == x2 * exp(s)
        x2 = shifted / scale
        dparams, dx1_from_net = st_vjp((dy2 * shifted, dy2))
        return (
            join_halves(y1, x2),
            join_halves(dy1 + dx1_from_net, dy2 * scale),
            dparams,
        )


class AffineCoupling(hk.Module):
    """Affine coupling with a softly bounded log-scale (as in Glow / RealNVP).

    Splits the last axis of ``x`` into halves ``x1, x2``; ``net(x1)`` returns an
    array whose last axis is twice that of ``x2``, split into a raw log-scale and
    a shift ``t``. The log-scale is bounded with
    ``s = scale_bound * tanh(raw / scale_bound)`` so that deep stacks stay
    invertible in float32, and ``y = (x1, x2 * exp(s) + t)``.

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
        scale_bound: float | None = 2.0,
        compute_dtype: Any = None,
        name: str | None = None,
    ):
        """Constructs the coupling.

        Args:
          net: Function of ``x1`` returning ``[..., 2 * half_channels]`` (raw
            log-scale, then shift). Builds and applies Haiku modules when called;
            its parameters live under ``<name>/~/net``.
          scale_bound: Bound of the soft clamp on the log-scale; ``None`` leaves the
            log-scale unbounded.
          compute_dtype: Optional dtype in which ``net`` computes; parameters and
            the residual stream keep their dtype.
          name: Name of the module.

        Raises:
          TypeError: If ``net`` is not callable, ``scale_bound`` is not a number
            or None, or ``compute_dtype`` is not None or a floating point dtype.
          ValueError: If ``scale_bound`` is not positive and finite.
        """
        check_name(type(self), name)
        super().__init__(name=name)
        module = self.module_name
        check_callable(module, "net", net)
        if scale_bound is not None:
            scale_bound = check_real(
                module,
                "scale_bound",
                scale_bound,
                "a positive finite number or None",
                low=0.0,
                low_inclusive=False,
            )
        compute_dtype = check_float_dtype(module, "compute_dtype", compute_dtype)
        self._net = Lifted(net, self, "net", compute_dtype)
        self._rule = AffineRule(self._net.apply, scale_bound, self.module_name)

    def _params_and_aux(self, x: Any) -> tuple[Any, Any]:
        half = check_splittable(self.module_name, x, _EXPECTED)
        x1 = x[..., :half] if hk.running_init() else None
        params, state = self._net.params_and_state(x1)
        return params, (state, *rng_keys(1))

    def __call__(self, x: jax.Array) -> jax.Array:
        """Applies the coupling to ``x`` of shape ``[batch, ..., channels]``."""
        params, aux = self._params_and_aux(x)
        return apply_rule(self._rule, params, aux, x, (self._net,))

    def forward_and_log_det(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Applies the coupling and returns the log-determinant of its Jacobian.

        Args:
          x: Input of shape ``[batch, ..., channels]``.

        Returns:
          ``(y, log_det)`` where ``log_det`` of shape ``[batch]`` is, per example,
          ``log|det dy/dx|`` (the sum of the bounded log-scales).

        Raises:
          ValueError: If the last axis of ``x`` is odd or ``x`` has rank < 2.
          TypeError: If ``x`` is not floating point.
        """
        params, aux = self._params_and_aux(x)
        y, state, log_det = self._rule.forward_and_log_det(params, aux, x)
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
        params, aux = self._params_and_aux(y)
        return self._rule.inverse(params, aux, y)
