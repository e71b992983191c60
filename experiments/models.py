"""The networks the memory sweep trains, each in four ways on the same parameters.

A configuration is a JSON-able dict (a *spec*): ``model`` (``"mlp"``,
``"revnet"``, ``"transformer"``), ``method``, ``depth``, ``batch`` and the model's
sizes. Methods:

* ``standard``: the blocks with ``reversible=False``, ordinary backprop.
* ``checkpoint``: the same ``reversible=False`` network with every coupling's
  ``__call__`` wrapped in ``hk.remat`` (through ``hk.intercept_methods``), i.e.
  per-block ``jax.checkpoint``: only block boundaries are stored.
* ``reversible``: the blocks with ``reversible=True``.
* ``generic`` (MLP only): the same math as a plain function, a ``lax.scan`` over
  the very same stacked weights inside ONE ``@revnet.invertible`` function.
* ``plain``: the same block functions in a Python loop, plain Haiku with
  ordinary backprop, the baseline a user has without revnet
  (:mod:`experiments.baselines`);
* ``layer_stack``: the same block functions under ``hk.layer_stack``.

All share one parameter tree (the ``standard`` model's ``init``, renamed or
sliced per layer for the two plain layouts), so the measured differences come
from the method alone.

Models: ``mlp`` (tanh-linear additive couplings), ``conv`` (the conv stack the
PyTorch peers MemCNN and RevLib benchmark: additive couplings whose ``F`` and
``G`` are Conv2D - BatchNorm - ReLU - Conv2D), ``revnet`` and ``transformer``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import revnet
from experiments import baselines, common
from revnet import blocks

MODELS = ("mlp", "conv", "revnet", "transformer")
METHODS = ("standard", "checkpoint", "reversible", "generic", "plain", "layer_stack")


class Unavailable(RuntimeError):
    """The library does not (yet) provide what a configuration needs."""


def default_sizes(model: str, quick: bool) -> dict[str, Any]:
    """Model sizes for the sweep (the depth and batch are swept separately)."""
    if model == "mlp":
        return {"width": 256, "batch": 512}
    if model == "conv":
        return {"image_size": 32, "batch": 16, "channels": 32}
    if model == "revnet":
        return {"image_size": 32, "batch": 8 if quick else 32, "channels": 16}
    if model == "transformer":
        return (
            {
                "seq_len": 64,
                "model_size": 64,
                "num_heads": 4,
                "mlp_size": 128,
                "batch": 8,
            }
            if quick
            else {
                "seq_len": 128,
                "model_size": 128,
                "num_heads": 4,
                "mlp_size": 512,
                "batch": 16,
            }
        )
    raise ValueError(f"unknown model {model!r}")


def _remat_couplings(counter: list[int]) -> Callable[..., Any]:
    """Method interceptor wrapping each coupling's ``__call__`` in ``hk.remat``."""
    couplings = (blocks.AdditiveCoupling, blocks.AffineCoupling)

    def interceptor(next_f, args, kwargs, context):
        if isinstance(context.module, couplings) and context.method_name == "__call__":
            counter[0] += 1
            return hk.remat(lambda *a: next_f(*a, **kwargs))(*args)
        return next_f(*args, **kwargs)

    return interceptor


def _mlp_forward(spec: dict[str, Any], reversible: bool) -> Callable[..., Any]:
    half = spec["width"] // 2

    def forward(x, is_training):
        del is_training

        def block(h):
            f = lambda u: jnp.tanh(hk.Linear(half, name="linear")(u))  # noqa: E731
            g = lambda u: jnp.tanh(hk.Linear(half, name="linear")(u))  # noqa: E731
            return blocks.AdditiveCoupling(f, g)(h)

        if spec.get("unrolled"):  # a Python chain of blocks: no scan
            stack = blocks.ReversibleSequence(
                [block] * spec["depth"], reversible=reversible
            )
        else:
            stack = blocks.ReversibleSequence(
                block, spec["depth"], reversible=reversible
            )
        return stack(x)

    return forward


def _conv_forward(spec: dict[str, Any], reversible: bool) -> Callable[..., Any]:
    half = spec["channels"] // 2

    def forward(x, is_training):
        def residual(h):
            h = hk.Conv2D(half, 3)(h)
            h = hk.BatchNorm(True, True, 0.9)(h, is_training)
            return hk.Conv2D(half, 3)(jax.nn.relu(h))

        def block(h):
            return blocks.AdditiveCoupling(residual, residual)(h)

        return blocks.ReversibleSequence(block, spec["depth"], reversible=reversible)(x)

    return forward


def _revnet_forward(spec: dict[str, Any], reversible: bool) -> Callable[..., Any]:
    if not hasattr(blocks, "RevNet"):
        raise Unavailable("revnet.blocks.RevNet is not available yet")
    config = revnet_config(spec)

    def forward(x, is_training):
        return blocks.RevNet(config, num_classes=10, reversible=reversible)(
            x, is_training
        )

    return forward


def revnet_config(spec: dict[str, Any]) -> Any:
    """A CIFAR-style RevNet config with ``depth`` units in each of three stages."""
    make = getattr(blocks, "RevNetConfig", None)
    depth, channels = spec["depth"], spec["channels"]
    widths = (channels, channels, 2 * channels, 4 * channels)
    if make is not None:
        return make(units=(depth, depth, depth), channels=widths)
    return {"units": (depth, depth, depth), "channels": widths}


def _transformer_forward(spec: dict[str, Any], reversible: bool) -> Callable[..., Any]:
    if not hasattr(blocks, "ReversibleTransformer"):
        raise Unavailable("revnet.blocks.ReversibleTransformer is not available yet")

    def forward(x, is_training):
        return blocks.ReversibleTransformer(
            num_layers=spec["depth"],
            num_heads=spec["num_heads"],
            model_size=spec["model_size"],
            mlp_size=spec["mlp_size"],
            reversible=reversible,
        )(x, is_training)

    return forward


_FORWARDS = {
    "mlp": _mlp_forward,
    "conv": _conv_forward,
    "revnet": _revnet_forward,
    "transformer": _transformer_forward,
}


def example_batch(spec: dict[str, Any]) -> tuple[jax.Array, jax.Array]:
    """Synthetic inputs and targets (memory and FLOPs do not depend on values)."""
    kx, ky = jax.random.split(jax.random.PRNGKey(1))
    b = spec["batch"]
    if spec["model"] == "mlp":
        shape = (b, spec["width"])
        return jax.random.normal(kx, shape), jax.random.normal(ky, shape)
    if spec["model"] == "conv":
        s, c = spec["image_size"], spec["channels"]
        x = jax.random.normal(kx, (b, s, s, c))
        return x, jax.random.normal(ky, x.shape)
    if spec["model"] == "revnet":
        s = spec["image_size"]
        x = jax.random.normal(kx, (b, s, s, 3))
        return x, jax.random.randint(ky, (b,), 0, 10)
    shape = (b, spec["seq_len"], spec["model_size"])
    return jax.random.normal(kx, shape), jax.random.normal(ky, shape)


def _loss(model: str, out: jax.Array, y: jax.Array) -> jax.Array:
    if model == "revnet":
        logp = jax.nn.log_softmax(out)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=-1))
    return jnp.mean((out - y) ** 2)


def _generic_apply(params: Any, x: jax.Array) -> jax.Array:
    """The MLP coupling stack as a plain function under ``@revnet.invertible``."""
    (f_path, f), (g_path, g) = sorted(params.items())
    assert f_path.endswith("/f/linear") and g_path.endswith("/g/linear"), params
    half = x.shape[-1] // 2

    @revnet.invertible
    def stack(h):
        def body(h, w):
            wf, bf, wg, bg = w
            h1, h2 = h[..., :half], h[..., half:]
            h1 = h1 + jnp.tanh(h2 @ wf + bf)
            h2 = h2 + jnp.tanh(h1 @ wg + bg)
            return jnp.concatenate([h1, h2], axis=-1), None

        return jax.lax.scan(body, h, (f["w"], f["b"], g["w"], g["b"]))[0]

    return stack(x)


@dataclasses.dataclass
class Built:
    """A configuration ready to compile.

    Attributes:
      grad_step: ``grad_step(params, state, x, y) -> (loss, grads, new_state)``.
      args: ``(params, state, x, y)``.
      num_params: Number of parameters.
      remat_calls: Couplings wrapped by the checkpoint method at trace time
        (None for other methods; 0 would mean the baseline is not what it says).
      init: ``(params, state)`` in the standard layout, to pass as ``init`` to
        the next ``build`` of the same model.
    """

    grad_step: Callable[..., Any]
    args: tuple[Any, Any, jax.Array, jax.Array]
    num_params: int
    remat_calls: list[int] | None
    init: tuple[Any, Any]


def build(
    spec: dict[str, Any], abstract: bool = False, init: tuple[Any, Any] | None = None
) -> Built:
    """Builds the training gradient step of ``spec`` (see the module docstring).

    Args:
      spec: The configuration.
      abstract: If True, ``args`` are ``jax.ShapeDtypeStruct``s (enough to compile
        and read memory and FLOPs; nothing is allocated or initialised).
      init: ``(params, state)`` from an earlier ``build`` of the same model,
        depth and sizes, to reuse instead of initialising again.

    Raises:
      Unavailable: If the model or method is not provided by the library.
      ValueError: For an unknown model or method.
    """
    model, method = spec["model"], spec["method"]
    if model not in _FORWARDS:
        raise ValueError(f"unknown model {model!r}; choose from {MODELS}")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    if method == "generic" and model != "mlp":
        raise Unavailable("the generic @invertible path is measured on the MLP only")
    reversible = method == "reversible"
    forward = _FORWARDS[model](spec, reversible)
    counter = [0] if method == "checkpoint" else None

    def run(x, is_training):
        if counter is not None:
            with hk.intercept_methods(_remat_couplings(counter)):
                return forward(x, is_training)
        if method in baselines.PLAIN_METHODS:
            with hk.intercept_methods(baselines.interceptor(method)):
                return forward(x, is_training)
        return forward(x, is_training)

    net = hk.transform_with_state(run)
    # Parameters always come from the standard network's init, so every method
    # trains the very same parameter tree.
    init_net = hk.transform_with_state(_FORWARDS[model](spec, False))
    key = jax.random.PRNGKey(0)
    if abstract:
        x, y = jax.eval_shape(lambda: example_batch(spec))
        params, state = jax.eval_shape(lambda k, x: init_net.init(k, x, True), key, x)
    else:
        x, y = example_batch(spec)
        if init is None:
            init = common.init_unoptimised(
                init_net.init, key, x, True, static_argnums=(2,)
            )
        params, state = init
    base = (params, state)
    if method in baselines.PLAIN_METHODS:
        params, state = (baselines.convert(t, method) for t in (params, state))

    if method == "generic":

        def loss_fn(params, state, x, y):
            return _loss(model, _generic_apply(params, x), y), state

    else:

        def loss_fn(params, state, x, y):
            out, new_state = net.apply(params, state, None, x, True)
            return _loss(model, out, y), new_state

    def grad_step(params, state, x, y):
        (loss, new_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, state, x, y
        )
        return loss, grads, new_state

    num_params = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(params))
    return Built(grad_step, (params, state, x, y), int(num_params), counter, base)
