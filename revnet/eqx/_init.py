"""A sequence's data-dependent initialisation (``ReversibleSequence.initialize``).

The blocks run one after another on the batch, each from its own input,
with :mod:`revnet._layers.data_init` on: each ActNorm takes its statistics
(over the sequence's batch axis) and reports its parameters, which are
returned as outputs of the vmapped block and written into a copy of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

from revnet.eqx.flow import actnorms


def _slice(tree: Any, i: int | None) -> Any:
    if i is None or tree is None:
        return tree
    return jax.tree.map(lambda a: a[i], tree)


def _with_reports(module: Any, seen: list, found: list, batched: bool) -> Any:
    """``module`` with the ActNorms at positions ``seen`` set to ``found``."""
    for k, (bias, log_scale) in zip(seen, found):
        if batched:  # the same on every example (taken over the batch axis)
            bias, log_scale = bias[0], log_scale[0]
        norm = actnorms(module)[k]._with(bias, log_scale)
        module = eqx.tree_at(lambda b, k=k: actnorms(b)[k], module, norm)
    return module


def initialized(seq: Any, per_layer: Any, x: jax.Array, make_layer: Callable) -> Any:
    """A copy of ``seq`` whose ActNorms are initialised from ``x``.

    Args:
      seq: The :class:`~revnet.eqx.ReversibleSequence`.
      per_layer: Its per-layer ``(params, state, keys)`` (stacked), or a
        list of them.
      x: The batch.
      make_layer: ``make_layer(static, axis_name, seen)``, the sequence's
        layer function reporting the ActNorms' parameters.

    Returns:
      The initialised sequence.
    """
    stacked = seq.stacked
    blocks = (seq.blocks,) if stacked else seq.blocks
    triples = [per_layer] if stacked else per_layer
    h, new_blocks = x, []
    for block, (params, substate, keys) in zip(blocks, triples):
        static = eqx.partition(block, eqx.is_array)[1]
        done = []
        for i in range(seq.num_layers) if stacked else (None,):
            one, key = _slice(params, i), _slice(keys, i)
            seen: list = []
            layer = make_layer(static, seq.axis_name, seen)
            (h, found), _ = layer(one, _slice(substate, i), key, h)
            module = eqx.combine(one, static)
            module = _with_reports(module, seen, found, seq.axis_name is not None)
            done.append(eqx.partition(module, eqx.is_array)[0])
        if stacked:
            params = jax.tree.map(lambda *a: jax.numpy.stack(a), *done)
        else:
            params = done[0]
        new_blocks.append(eqx.combine(params, static))
    new = new_blocks[0] if stacked else tuple(new_blocks)
    return eqx.tree_at(lambda s: s.blocks, seq, new)
