"""Convolutions in the layout XLA:CPU runs fast, for the VJPs the engine takes.

XLA:CPU hands a convolution to its fast (Eigen) kernel only in the canonical
layout: input ``[batch, spatial..., feature]``, kernel ``[spatial..., in,
out]``, output ``[batch, spatial..., feature]``. Its canonicalization pass
rewrites other layouts only for convolutions at the top level of a program.
The convolutions JAX emits for a convolution's VJP are not canonical (the
input's cotangent is ``b01f_01oi->b01f``, the kernel's ``f01b_i01o->01bf``),
and inside the reversed ``scan`` of a reversible stack XLA:CPU runs them as a
naive loop nest, 25-40x slower than the same step written as plain Haiku.

:func:`conv` evaluates ``conv_general_dilated`` as explicit transposes around a
canonical convolution, and its VJP is JAX's own transpose rule with every
convolution that rule emits evaluated the same way. The transposes change
layouts only, so values and gradients are the primitive's; XLA fuses them into
neighbouring copies. The interpreter evaluates every ``conv_general_dilated``
through :func:`conv` (see :func:`registry.register_evaluator`).

Only on CPU: other backends choose convolution layouts themselves (XLA:GPU
assigns cuDNN's), and there the primitive is bound as it is.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from revnet._engine import jaxpr as jx
from revnet._engine import registry

_CONV = "conv_general_dilated"


def _canonical_numbers(n_spatial: int) -> lax.ConvDimensionNumbers:
    """``b01f_01io->b01f`` (NHWC/HWIO/NHWC in 2-d) for ``n_spatial`` dims."""
    spatial = tuple(range(1, n_spatial + 1))
    lhs = (0, n_spatial + 1, *spatial)
    rhs = (n_spatial + 1, n_spatial, *range(n_spatial))
    return lax.ConvDimensionNumbers(lhs, rhs, lhs)


def canonical(lhs: jax.Array, rhs: jax.Array, **params: Any) -> jax.Array:
    """``lax.conv_general_dilated(lhs, rhs, **params)`` in the canonical layout.

    Args:
      lhs: The input, laid out as ``params["dimension_numbers"].lhs_spec`` says.
      rhs: The kernel, laid out as ``rhs_spec`` says.
      **params: The equation's params (``dimension_numbers`` as
        ``lax.ConvDimensionNumbers``, strides, padding pairs, dilations, group
        counts, precision, preferred element type).

    Returns:
      The convolution, laid out as ``out_spec`` says.
    """
    dn = params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    n_spatial = len(lhs_spec) - 2
    numbers = _canonical_numbers(n_spatial)
    if dn == numbers:
        return lax.conv_general_dilated(lhs, rhs, **params)
    out = lax.conv_general_dilated(
        jnp.transpose(lhs, (lhs_spec[0], *lhs_spec[2:], lhs_spec[1])),
        jnp.transpose(rhs, (*rhs_spec[2:], rhs_spec[1], rhs_spec[0])),
        **{**params, "dimension_numbers": numbers},
    )
    order = (out_spec[0], *out_spec[2:], out_spec[1])
    return jnp.transpose(out, tuple(int(a) for a in np.argsort(order)))


def _canonical_convs(name: str, params: dict[str, Any], ins: list[Any]):
    return [canonical(*ins, **params)] if name == _CONV else None


@functools.lru_cache(maxsize=256)
def _differentiable(key: tuple) -> Any:
    """:func:`canonical` with params ``key``, whose VJP is canonical too."""
    params = dict(key)

    def plain(lhs, rhs):
        return lax.conv_general_dilated(lhs, rhs, **params)

    @jax.custom_vjp
    def f(lhs, rhs):
        return canonical(lhs, rhs, **params)

    def fwd(lhs, rhs):
        return f(lhs, rhs), (lhs, rhs)

    def bwd(res, g):
        def pullback(lhs, rhs, g):
            return jax.vjp(plain, lhs, rhs)[1](g)

        return tuple(jx.eval_with(pullback, (*res, g), _canonical_convs))

    f.defvjp(fwd, bwd)
    return f


def conv(params: dict[str, Any], ins: list[Any]) -> list[Any]:
    """Evaluates a ``conv_general_dilated`` equation; its VJP is canonical too.

    Args:
      params: The equation's bind params.
      ins: ``[lhs, rhs]``.

    Returns:
      ``[output]``.
    """
    if jax.default_backend() != "cpu":
        return [lax.conv_general_dilated(*ins, **params)]
    try:
        key = tuple(sorted(params.items()))
        hash(key)
    except TypeError:  # params that cannot key a cache: JAX's own VJP
        return [lax.conv_general_dilated(*ins, **params)]
    return [_differentiable(key)(*ins)]


registry.register_evaluator(_CONV, conv)
