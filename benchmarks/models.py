"""The networks the benchmarks train, every way, on the same parameters.

A configuration is a JSON-able dict (a *spec*): ``model`` (``"mlp"``,
``"conv"``, ``"revnet"``, ``"transformer"``), ``method``, ``depth``, ``batch``
and the model's sizes. Methods:

* ``standard``: the blocks with ``reversible=False``, ordinary backprop.
* ``checkpoint``: the same network with every coupling's ``__call__`` wrapped in
  ``hk.remat`` (per-block ``jax.checkpoint``: only block boundaries stored).
* ``reversible``: the blocks with ``reversible=True``.
* ``generic`` (MLP only): the same math as a plain function, a ``lax.scan`` over
  the very same stacked weights inside ONE ``@revnet.invertible`` function.
* ``plain``: the same block functions in a Python loop, each layer in its own
  name scope: plain Haiku with ordinary, unrolled backprop, the baseline a user
  has without revnet;
* ``layer_stack``: the same block functions under ``hk.layer_stack``.
* ``layer_stack_remat``: the same, each layer in ``hk.remat``: JAX's best
  same-FLOP baseline (a scan that stores one activation per layer).

All share one parameter tree (the ``standard`` model's ``init``, renamed or
sliced per layer for the two plain layouts by :func:`convert`), so measured
differences come from the method alone. The ``conv`` model is the stack the
PyTorch peers MemCNN and RevLib benchmark (additive couplings whose ``F`` and
``G`` are Conv2D - BatchNorm - ReLU - Conv2D).

Run as ``python -m benchmarks.models '<spec json>'`` it is the fresh-process
worker: it runs ``spec.get("steps", 3)`` SGD steps and prints the peak RSS, or
with ``"time_steps": n`` times ``n`` gradient steps and prints their median.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import revnet
from benchmarks import measure
from revnet import blocks

MODELS = ("mlp", "conv", "revnet", "transformer")
METHODS = (
    "standard",
    "checkpoint",
    "reversible",
    "generic",
    "plain",
    "layer_stack",
    "layer_stack_remat",
)


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


def intercept_calls(types: Any, run: Callable[..., Any]) -> Callable[..., Any]:
    """A method interceptor (``hk.intercept_methods``) replacing ``__call__``.

    Args:
      types: The module class (or tuple of classes) whose calls are replaced.
      run: ``run(module, next_f, args, kwargs)``, called in place of each such
        module's ``__call__``; ``next_f(*args, **kwargs)`` runs the original.
        Other methods and modules run as they are.
    """

    def interceptor(next_f, args, kwargs, context):
        if isinstance(context.module, types) and context.method_name == "__call__":
            return run(context.module, next_f, args, kwargs)
        return next_f(*args, **kwargs)

    return interceptor


def _remat_couplings(counter: list[int]) -> Callable[..., Any]:
    """Method interceptor wrapping each coupling's ``__call__`` in ``hk.remat``."""

    def run(module, next_f, args, kwargs):
        del module
        counter[0] += 1
        return hk.remat(lambda *a: next_f(*a, **kwargs))(*args)

    return intercept_calls((blocks.AdditiveCoupling, blocks.AffineCoupling), run)


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
    layout = method if method in PLAIN_METHODS else None
    if method == "layer_stack_remat":
        # Its unrolled twin (for FLOPs) is the plain chain, each layer remat'd.
        layout = "plain" if spec.get("unrolled") else "layer_stack"
        spec = {k: v for k, v in spec.items() if k != "unrolled"}
    forward = _FORWARDS[model](spec, reversible)
    counter = [0] if method == "checkpoint" else None

    def run(x, is_training):
        if counter is not None:
            with hk.intercept_methods(_remat_couplings(counter)):
                return forward(x, is_training)
        if layout is not None:
            remat = method == "layer_stack_remat"
            with hk.intercept_methods(plain_interceptor(layout, remat=remat)):
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
            init = init_unoptimised(init_net.init, key, x, True, static_argnums=(2,))
        params, state = init
    base = (params, state)
    if layout is not None:
        params, state = (convert(t, layout) for t in (params, state))

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


PLAIN_METHODS = ("plain", "layer_stack")
# Methods whose compiled step is an unrolled chain of blocks; the others scan
# one block, which ``cost_analysis`` counts once: their FLOPs are comparable
# with each other (per block), not with these.
UNROLLED_METHODS = ("plain",)
_STACKED = "/~/layers/"


def plain_interceptor(
    method: str, *, remat: bool = False, spec: Any = None
) -> Callable[..., Any]:
    """A method interceptor running each ``ReversibleSequence`` as ``method``.

    Args:
      method: One of :data:`PLAIN_METHODS`.
      remat: Wrap each layer in ``hk.remat``.
      spec: A ``PartitionSpec`` the stream is constrained to before the stack
        and before and after each layer (None: no constraint).
    """
    if method not in PLAIN_METHODS:
        raise ValueError(f"unknown plain method {method!r}; use {PLAIN_METHODS}")

    def pin(h):
        return h if spec is None else blocks.constrain(h, spec)

    def run(seq, next_f, args, kwargs):
        del next_f
        if len(seq.block_fns) != 1:
            raise ValueError(
                f"{seq.module_name}: only a repeated block can be run as {method}"
            )
        (block_fn,) = seq.block_fns
        x, *rest = args

        def layer(h):
            return pin(block_fn(pin(h), *rest, **kwargs))

        layer = hk.remat(layer) if remat else layer
        x = pin(x)
        if method == "layer_stack":
            return hk.layer_stack(seq.num_layers, name="layers")(layer)(x)
        for i in range(seq.num_layers):
            with hk.name_scope(f"layer_{i}"):
                x = layer(x)
        return x

    return intercept_calls(blocks.ReversibleSequence, run)


def compare_to_best_plain(stats: dict[str, dict[str, Any]]) -> str | None:
    """Adds ratios to the best plain baseline to each method's measurements.

    The one place the benchmarks (``memory``, ``speed``) pick the baseline of
    their step-time ratios.

    Args:
      stats: ``{method: {"median_s", "temp_bytes", "samples_s", ...}}`` at one
        depth, ``samples_s`` one time per interleaved round.

    Returns:
      The best plain method, the faster (median step time) of those in
      :data:`PLAIN_METHODS` that were timed, or None if none was. Every timed
      entry gains ``best_plain``, ``time_vs_best_plain`` (the ratio of the
      medians), ``temp_vs_best_plain`` and, from the per-round ratios,
      ``time_vs_best_plain_min`` and ``_max`` (:func:`measure.ratio_spread`).
    """
    timed = [m for m in PLAIN_METHODS if "median_s" in stats.get(m, {})]
    if not timed:
        return None
    name = min(timed, key=lambda m: stats[m]["median_s"])
    best = stats[name]
    for entry in stats.values():
        if "median_s" in entry:
            entry["best_plain"] = name
            entry["time_vs_best_plain"] = entry["median_s"] / best["median_s"]
            entry["temp_vs_best_plain"] = entry["temp_bytes"] / max(
                best["temp_bytes"], 1.0
            )
            spread = measure.ratio_spread(
                entry.get("samples_s", []), best.get("samples_s", [])
            )
            if spread is not None:
                entry["time_vs_best_plain_min"] = spread["min"]
                entry["time_vs_best_plain_max"] = spread["max"]
    return name


def convert(tree: Any, method: str) -> Any:
    """The reversible model's ``tree`` (params or state) in ``method``'s layout.

    Args:
      tree: A Haiku params or state mapping of a model built with
        ``ReversibleSequence``s (either ``reversible`` setting).
      method: ``"plain"`` or ``"layer_stack"``.

    Returns:
      A new mapping: stacked leaves are renamed (``layer_stack``) or sliced
      into one entry per layer (``plain``); other entries are unchanged.
    """
    if method not in PLAIN_METHODS:
        raise ValueError(f"unknown plain method {method!r}; use {PLAIN_METHODS}")
    out: dict[str, Any] = {}
    for path, leaves in tree.items():
        if _STACKED not in path:
            out[path] = leaves
            continue
        head, tail = path.rsplit(_STACKED, 1)
        if method == "layer_stack":
            out[f"{head}/layers/{tail}"] = leaves
            continue
        depth = len(next(iter(leaves.values())))
        for i in range(depth):
            out[f"{head}/layer_{i}/{tail}"] = {
                k: _layer(v, i) for k, v in leaves.items()
            }
    return out


def _layer(leaf: Any, i: int) -> Any:
    if isinstance(leaf, jax.ShapeDtypeStruct):  # an abstract (eval_shape) tree
        return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype)
    return leaf[i]


def init_unoptimised(init: Callable[..., Any], *args: Any, static_argnums=()) -> Any:
    """``jax.jit(init)(*args)`` compiled without XLA backend optimisation.

    An optimised CPU compile of a RevNet's ``init`` takes ~20 s on a loaded
    2-core machine, ~3 s at ``xla_backend_optimization_level=0``; the values
    agree to float32 rounding, and every method starts from this one init.
    """
    dynamic = [a for i, a in enumerate(args) if i not in static_argnums]
    lowered = jax.jit(init, static_argnums=static_argnums).lower(*args)
    return lowered.compile({"xla_backend_optimization_level": 0})(*dynamic)


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One configuration's peak RSS of SGD steps, or its median step time.

    ``peak_rss_mib`` is the whole process's peak (imports and compilation);
    the high-water mark is then reset just before the steps, so
    ``step_peak_rss_mib`` and ``step_rss_increase_mib`` (over the resident
    memory before them) are the steps' own (``step_hwm_reset`` says whether
    the reset worked).
    """
    built = build(spec)
    if "time_steps" in spec:
        compiled, stats = measure.compile_stats(built.grad_step, *built.args)
        step = {"step": lambda: compiled(*built.args)}
        times = measure.median_times(step, int(spec["time_steps"]))["step"]
        keep = ("temp_bytes", "flops", "compile_s")
        return {**times, **{k: stats[k] for k in keep}}

    def train_step(params, state, x, y):
        loss, grads, state = built.grad_step(params, state, x, y)
        params = jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)
        return params, state, loss

    params, state, x, y = built.args
    compiled = jax.jit(train_step, donate_argnums=(0, 1)).lower(*built.args).compile()
    setup_peak = measure.rss_mib()
    reset = measure.reset_peak_rss()
    before = measure.rss_mib("VmRSS")
    steps = int(spec.get("steps", 3))
    for _ in range(steps):
        params, state, loss = compiled(params, state, x, y)
    jax.block_until_ready(loss)
    step_peak = measure.rss_mib("VmHWM") if reset else None
    if before is None or step_peak is None:  # not Linux: compile-dominated
        before, step_peak, reset = before or setup_peak, measure.rss_mib(), False
    return {
        "peak_rss_mib": max(setup_peak, measure.rss_mib()),
        "setup_peak_rss_mib": setup_peak,
        "rss_before_step_mib": before,
        "step_peak_rss_mib": step_peak,
        "step_rss_increase_mib": step_peak - before,
        "step_hwm_reset": reset,
        "steps": steps,
        "loss": float(loss),
    }


if __name__ == "__main__":
    print(json.dumps(worker(json.loads(sys.argv[1]))))
