"""Normalizing-flow building blocks, framework-free.

A flow ``z = f(x)`` is trained by maximum likelihood, ``log p(x) =
log_prob(z) + log|det df/dx|``. revnet derives the log-determinant from the
program (:func:`revnet.forward_and_log_det`), so a flow here is plain JAX:

* :func:`actnorm` and :func:`actnorm_init` (data-dependent initialisation);
* :func:`lu_conv` and :func:`lu_conv_init`: the invertible 1x1 convolution,
  LU-parametrised, its log-determinant O(C);
* :func:`squeeze`, :func:`unsqueeze`, :func:`split` and :func:`merge`: the
  layout steps of a multi-scale flow;
* :class:`StandardNormal`: the base density, ``log_prob`` and ``sample``.

The couplings and the O(1)-memory ``ReversibleSequence`` are in the front
doors, which also wrap ActNorm and the 1x1 convolution as modules:
``revnet.blocks`` (Haiku), ``revnet.nnx`` and ``revnet.eqx``.

Example:

>>> import jax, jax.numpy as jnp, revnet
>>> from revnet import flows
>>> x = jax.random.normal(jax.random.key(0), (8, 4, 4, 3))
>>> w = flows.lu_conv_init(jax.random.key(1), 12)
>>> def flow(w, x):
...     return flows.lu_conv(*w, flows.squeeze(x))
>>> z, log_det = revnet.forward_and_log_det(flow, w, x, known_argnums=0,
...                                         batch_ndim=1)
>>> base = flows.StandardNormal(z.shape[1:])
>>> (base.log_prob(z) + log_det).shape
(8,)
"""

from revnet.flows.actnorm import actnorm, actnorm_init
from revnet.flows.lu_conv import lu_conv, lu_conv_init, lu_matrix
from revnet.flows.normal import StandardNormal
from revnet.flows.squeeze import merge, split, squeeze, unsqueeze

__all__ = [
    "StandardNormal",
    "actnorm",
    "actnorm_init",
    "lu_conv",
    "lu_conv_init",
    "lu_matrix",
    "merge",
    "split",
    "squeeze",
    "unsqueeze",
]
