"""Flow layers with parameters: ``ActNorm`` and ``InvertibleConv1x1`` (Glow).

Both act on the last axis of ``[batch, ..., channels]`` and are plain code the
core inverts, around the framework-free functions of :mod:`revnet.flows`.
Their ``forward_and_log_det`` is derived from the program
(:func:`revnet.forward_and_log_det`), as is that of a whole
:class:`~revnet.blocks.ReversibleSequence` of flow steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import haiku as hk
import jax

from revnet._checks import check_real
from revnet._layers.checks import check_input
from revnet._layers.flow_layer import FlowMethods
from revnet.blocks._names import check_name
from revnet.flows import actnorm, actnorm_init, lu_conv, lu_conv_init

_EXPECTED = "[batch, ..., channels]"


class FlowLayer(FlowMethods, hk.Module):
    """A flow layer: ``_forward(x)`` returns the pure map ``h -> y``; the call,
    the derived log-determinant and the inverse follow from it."""


class ActNorm(FlowLayer):
    """Per-channel ``y = (x + bias) * exp(log_scale)``, initialised from data.

    At ``init`` the bias and log-scale are set so that the batch given has
    zero mean and unit variance per channel (Glow's data-dependent
    initialisation); inside a :class:`~revnet.blocks.ReversibleSequence` each
    layer is initialised from its own input. The log-determinant is the sum
    of ``log_scale`` over every position.

    Example:

    >>> model = hk.transform(lambda x: ActNorm().forward_and_log_det(x))
    >>> x = 3.0 + jax.random.normal(jax.random.key(0), (16, 4))
    >>> params = model.init(None, x)
    >>> y, log_det = model.apply(params, None, x)
    >>> bool(jnp.allclose(y.mean(0), 0, atol=1e-5)), log_det.shape
    (True, (16,))
    """

    def __init__(self, eps: float = 1e-6, name: str | None = None):
        """Constructs the layer.

        Args:
          eps: Added to the standard deviation at initialisation.
          name: Name of the module.

        Raises:
          TypeError: If ``eps`` is not a number.
          ValueError: If ``eps`` is not positive and finite.
        """
        check_name(type(self), name)
        super().__init__(name=name)
        self.eps = check_real(
            self.module_name,
            "eps",
            eps,
            "a positive number",
            low=0.0,
            low_inclusive=False,
        )

    def _forward(self, x: Any) -> Callable[[jax.Array], jax.Array]:
        check_input(self.module_name, x, min_rank=2, expected=_EXPECTED)
        c, dtype = x.shape[-1], x.dtype
        stats = actnorm_init(x, eps=self.eps) if hk.running_init() else None
        bias = hk.get_parameter(
            "bias", [c], dtype, init=lambda *_: stats[0].astype(dtype)
        )
        log_scale = hk.get_parameter(
            "log_scale", [c], dtype, init=lambda *_: stats[1].astype(dtype)
        )
        return lambda h: actnorm(bias, log_scale, h)


class InvertibleConv1x1(FlowLayer):
    """Glow's invertible 1x1 convolution, LU-parametrised: ``y = x @ W``.

    ``W = L (U + diag(d))`` starts as a random rotation; its log-determinant
    per position is ``sum(log|d|)``, O(C), and its inverse two triangular
    solves (:func:`revnet.flows.lu_conv`).

    Example:

    >>> model = hk.transform(lambda x: InvertibleConv1x1().forward_and_log_det(x))
    >>> x = jnp.ones((2, 4, 4, 6))
    >>> params = model.init(jax.random.key(0), x)
    >>> y, log_det = model.apply(params, None, x)
    >>> y.shape, bool(jnp.allclose(log_det, 0, atol=1e-4))
    ((2, 4, 4, 6), True)
    """

    def __init__(self, name: str | None = None):
        """Constructs the layer.

        Args:
          name: Name of the module.
        """
        check_name(type(self), name)
        super().__init__(name=name)

    def _forward(self, x: Any) -> Callable[[jax.Array], jax.Array]:
        check_input(self.module_name, x, min_rank=2, expected=_EXPECTED)
        c, dtype = x.shape[-1], x.dtype
        w = lu_conv_init(hk.next_rng_key(), c, dtype) if hk.running_init() else None
        names = ("lower", "upper", "diag")
        shapes = ([c, c], [c, c], [c])
        lower, upper, diag = (
            hk.get_parameter(n, s, dtype, init=lambda *_, i=i: w[i])
            for i, (n, s) in enumerate(zip(names, shapes))
        )
        return lambda h: lu_conv(lower, upper, diag, h)
