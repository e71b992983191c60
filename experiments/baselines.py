"""The plain alternatives a user has to a ``ReversibleSequence``, on its parameters.

Every model of the experiments is built from ``ReversibleSequence``s. A Haiku
method interceptor replaces each sequence's ``__call__`` by what a user would
write without revnet, calling the very same block function:

* ``plain``: a Python loop, ``for i in range(n): h = block_fn(h)``, each layer
  in its own name scope (``.../layer_3/...``): ordinary, unrolled backprop;
* ``layer_stack``: ``hk.layer_stack(n)(block_fn)``, a ``lax.scan`` over
  parameters stacked on a leading axis (``.../layers/...``).

:func:`convert` maps the reversible model's parameter or state tree (stacked
under ``.../~/layers/...``) to either layout, so all methods train the same
numbers. Only sequences of one repeated block (``num_layers`` copies) can be
replaced; a list of different blocks raises ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import haiku as hk
import jax

from revnet import blocks

PLAIN_METHODS = ("plain", "layer_stack")
_STACKED = "/~/layers/"


def interceptor(method: str) -> Callable[..., Any]:
    """A method interceptor running each ``ReversibleSequence`` as ``method``."""
    if method not in PLAIN_METHODS:
        raise ValueError(f"unknown plain method {method!r}; use {PLAIN_METHODS}")

    def intercept(next_f, args, kwargs, context):
        seq = context.module
        if (
            not isinstance(seq, blocks.ReversibleSequence)
            or context.method_name != "__call__"
        ):
            return next_f(*args, **kwargs)
        if len(seq.block_fns) != 1:
            raise ValueError(
                f"{seq.module_name}: only a repeated block can be run as {method}"
            )
        (block_fn,) = seq.block_fns
        x, *rest = args

        def layer(h):
            return block_fn(h, *rest, **kwargs)

        if method == "layer_stack":
            return hk.layer_stack(seq.num_layers, name="layers")(layer)(x)
        for i in range(seq.num_layers):
            with hk.name_scope(f"layer_{i}"):
                x = layer(x)
        return x

    return intercept


def compare_to_best_plain(stats: dict[str, dict[str, Any]]) -> str | None:
    """Adds ratios to the best plain baseline to each method's measurements.

    Args:
      stats: ``{method: {"median_s", "temp_bytes", ...}}`` at one depth.

    Returns:
      The best plain method, the faster (median step time) of those in
      :data:`PLAIN_METHODS` that were timed, or None if none was. Every timed
      entry gains ``time_vs_best_plain`` and ``temp_vs_best_plain``.
    """
    timed = [m for m in PLAIN_METHODS if "median_s" in stats.get(m, {})]
    if not timed:
        return None
    name = min(timed, key=lambda m: stats[m]["median_s"])
    best = stats[name]
    for entry in stats.values():
        if "median_s" in entry:
            entry["time_vs_best_plain"] = entry["median_s"] / best["median_s"]
            entry["temp_vs_best_plain"] = entry["temp_bytes"] / max(
                best["temp_bytes"], 1.0
            )
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
