"""revnet: reversible neural networks with invertible VJPs for JAX.

revnet inverts a JAX function equation by equation, so that its backward pass
rebuilds each activation from the outputs instead of storing it: activation
memory stays flat as depth grows, for about one extra forward pass of compute,
and the gradients are those of plain ``jax.grad``.

The core:

* :func:`invertible` makes a function's backward pass rebuild its activations
  (put one boundary around the whole stack); :func:`inverse` returns its
  inverse, outputs to inputs.
* :class:`custom_ivjp` gives a function an inverse you write yourself;
  :func:`register_inverse` adds an inverse rule for one JAX primitive.
* :class:`NotInvertibleError` is raised at trace time, naming the primitive,
  the input that cannot be recovered and your source line.

Flows: :func:`forward_and_log_det` returns a function's outputs and
``log|det J|``, derived from the program (one per example with
``batch_ndim=1``); inside :func:`invertible` its gradient costs memory flat in
depth. :mod:`revnet.flows` holds ActNorm, the LU-parametrised 1x1
convolution, squeeze, the multi-scale split and a standard-normal base,
framework-free; each front door wraps them as modules.

Loops: :func:`while_loop` and :func:`scan` differentiate any body in reverse
mode, with ``mode="auto"`` (the default), ``"invert"``, ``"store"`` or
``"checkpoint"``, and ``anchor_every=k`` to store the carry every ``k``
steps (:mod:`revnet.loops`).

Per layer: a :class:`StackPlan` on any door's stack chooses which layers
store their residuals (as plain backprop), which recompute from their input
(as ``jax.checkpoint``) and which invert; where memory is to spare, storing
is the fastest. A :class:`Budget` instead finds the plan by compiling: the
most stored layers that fit, then the most recomputed.

What is kept: :func:`stored` lists what a differentiated function keeps for
its backward pass (outputs, constants, decisions, stored carries, anchors),
and a :class:`StoredGrowthWarning` says when that grows with depth or steps.
Results that jump (comparisons, ``round``, ``rem``, indices) are stored, at
any depth; kinks (``relu``, ``max``, ``leaky_relu``) are recomputed unless
``kinks="store"``; :func:`decision` and :func:`kink` mark a select either way.

Exact mode: :mod:`revnet.exact` keeps an additive stream on a fixed-point
grid, so that it is rebuilt bit for bit at any depth (``exact=True`` on every
door's ``AdditiveCoupling``).

Accuracy: :func:`set_runtime_checks` turns a non-finite reconstruction into an
error; a :class:`DriftMonitor` reads the reconstruction error at the anchors
(:class:`DriftWarning`, :class:`DriftError`).

Haiku: :mod:`revnet.blocks` holds the couplings, ``ReversibleSequence`` (an
O(1)-memory stack of your own blocks), the RevNet family,
``ReversibleTransformer`` and the sharding helpers (``help(revnet.blocks)``).
Flax NNX: :mod:`revnet.nnx`; Equinox: :mod:`revnet.eqx` (the same couplings,
sequence, transformer block and flow layers, each the framework's way). Each
framework is an extra: ``pip install '.[haiku]'``, ``'.[nnx]'``,
``'.[equinox]'``; the core needs JAX only.

The guides are in ``docs/`` (``make docs`` builds the site): getting
started, what can be inverted, decisions and what is stored, Haiku, Flax NNX,
Equinox, loops, normalizing flows, numerical accuracy, scaling out,
performance, and the limits. Every Python block there runs on its own.

Example:

>>> import jax, jax.numpy as jnp, revnet
>>> @revnet.invertible
... def net(x1, x2):
...     y1 = x1 + jnp.tanh(x2)
...     return y1, x2 + jnp.tanh(y1)
>>> def loss(x1, x2, f=net):
...     return jnp.sum(f(x1, x2)[1] ** 2)
>>> x = jnp.linspace(-1.0, 1.0, 4)
>>> grad = jax.grad(loss)(x, x)                     # rebuilds, stores nothing
>>> plain = jax.grad(loss)(x, x, net.__wrapped__)   # ordinary backprop
>>> bool(jnp.allclose(grad, plain, rtol=1e-5, atol=1e-6))
True
>>> x1, x2 = revnet.inverse(net, x, x)(net(x, x))   # the inputs, rebuilt
>>> bool(jnp.allclose(x1, x, atol=1e-6))
True
"""

from revnet import exact, rules  # noqa: F401  (rules: the built-in inverse rules)
from revnet._engine import NotInvertibleError, register_inverse
from revnet._engine.runtime_checks import set_runtime_checks
from revnet._forward_and_log_det import forward_and_log_det
from revnet._layers.budget import Budget
from revnet._layers.plan import StackPlan
from revnet._stored import StoredGrowthWarning, stored
from revnet.drift import (
    DriftError,
    DriftMonitor,
    DriftReading,
    DriftWarning,
    set_boundary_check,
)
from revnet.invertible import inverse, invertible
from revnet.ivjp import custom_ivjp
from revnet.loops import scan, while_loop
from revnet.marks import decision, kink

__version__ = "0.1.0"

__all__ = [
    "Budget",
    "DriftError",
    "DriftMonitor",
    "DriftReading",
    "DriftWarning",
    "NotInvertibleError",
    "StackPlan",
    "StoredGrowthWarning",
    "custom_ivjp",
    "decision",
    "forward_and_log_det",
    "inverse",
    "invertible",
    "kink",
    "register_inverse",
    "scan",
    "set_runtime_checks",
    "stored",
    "while_loop",
    "set_boundary_check",
]
