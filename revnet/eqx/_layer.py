"""One Equinox block as the framework-free stack's pure layer function.

``eqx.combine`` puts a layer's slice of the stacked arrays back into the
block, which is then called by Equinox's convention (with or without
``eqx.nn.State``), vmapped over the batch; a failure on one example is
reported in one line saying whether the block runs on the whole batch instead.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import equinox as eqx
import jax

from revnet._layers import data_init
from revnet.eqx._call import call, raised_by_revnet, traces
from revnet.eqx.flow import actnorms

_NAME = "ReversibleSequence"


def layer_function(
    static: Any, axis_name: Hashable | None, seen: list | None = None
) -> Callable[..., Any]:
    """The pure layer function ``(params, state, key, h) -> (y, new_state)``
    of the blocks split off ``static`` (``eqx.partition``), vmapped over the
    batch when ``axis_name`` is not None.

    With ``seen`` (a sequence's ``initialize``), the block runs with
    data-dependent initialisation on: its output is ``(y, params)``, the
    parameters its ActNorms report, and ``seen`` gets their positions among
    the block's ActNorms."""

    def layer(params, state, key, h):
        block = eqx.combine(params, static)

        def one(h, state, key):
            if seen is None:
                return call(_NAME, "the block", block, h, state, key)
            with data_init.collecting() as found:
                y, sub = call(_NAME, "the block", block, h, state, key)
            nodes = actnorms(block)
            seen[:] = [next(i for i, n in enumerate(nodes) if n is m) for m, _ in found]
            return (y, [p for _, p in found]), sub

        if axis_name is None:
            return one(h, state, key)
        keys = None if key is None else jax.random.split(key, h.shape[0])
        batched = jax.vmap(
            one,
            in_axes=(0, None, None if keys is None else 0),
            out_axes=(0, None),
            axis_name=axis_name,
        )
        try:
            return batched(h, state, keys)
        except (TypeError, ValueError) as e:
            if raised_by_revnet(e):
                raise
            said = (
                str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            )
            failed = (
                f"{_NAME}: the block failed on one example of x, of shape "
                f"{h.shape[1:]} (the sequence vmaps it over x's leading axis, "
                f"axis_name={axis_name!r})"
            )
            one = None if keys is None else keys[:1]
            if traces(lambda h: batched(h[None], state, one), h):
                raise type(e)(
                    f"{failed}, and runs on all of x as one example: build the "
                    "sequence with axis_name=None and jax.vmap it over examples. "
                    f"The block said: {said}"
                ) from e
            raise type(e)(
                f"{failed}: {said.rstrip('.')}; give x the per-example shape the "
                "blocks were built for."
            ) from e

    return layer
