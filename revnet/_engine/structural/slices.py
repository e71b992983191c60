"""The structural rule for ``slice`` equations that cover a value together.

``slice`` equations whose known outputs together cover an unknown value
(``x[..., :h]``, ``x[..., h:]``) rebuild it, by concatenation when they cut
along one axis in order, else by placing each piece.
"""

from __future__ import annotations

import numpy as np
from jax import lax

from revnet._engine import jaxpr as jx
from revnet._engine import registry, sharded_types
from revnet._engine.interpreter import Handler, register_handler
from revnet._engine.plan import Tile


class TileRule(registry.StructuralRule):
    name = "slice"

    def analyze(self, an, i, eqn, ins, outs):
        if not all(outs):
            return None
        operand = an.wiring.eqn_ins[i][0]
        if an.is_known(operand):
            return None
        shape = an.avals[operand].shape
        cover, known_cover = np.zeros(shape, bool), np.zeros(shape, bool)
        used, missing = [], []
        for j in an.consumers.get(operand, ()):
            e = an.jaxpr.eqns[j]
            if jx.primitive_name(e) != "slice" or an.wiring.eqn_ins[j][0] != operand:
                continue
            strides = e.params.get("strides")
            if strides is not None and any(s != 1 for s in strides):
                continue
            start, limit = e.params["start_indices"], e.params["limit_indices"]
            region = tuple(slice(a, b) for a, b in zip(start, limit))
            cover[region] = True
            unknown = [v for v in an.wiring.eqn_outs[j] if not an.is_known(v)]
            if unknown:
                missing += unknown
                continue
            known_cover[region] = True
            used.append(j)
        if not used or not known_cover.all():
            # Pieces still unknown that would complete the cover: the equations
            # that fail to rebuild them are the cause (Analysis._cause).
            an.fail(
                i,
                eqn,
                "`slice` has no inverse rule; slices rebuild a value only when "
                "together they cover it",
                waits_for=missing if cover.all() else (),
            )
            return None
        return Tile(operand, tuple(used)), [operand], tuple(used)


class _TileHandler(Handler):
    def needs(self, it, step):
        return [v for j in step.eqns for v in it.wiring.eqn_outs[j]]

    def run(self, it, step, out_cts):
        eqns = [it.jaxpr.eqns[j] for j in step.eqns]
        aval = jx.aval(eqns[0].invars[0])
        pieces = [it.read(it.wiring.eqn_outs[j][0]) for j in step.eqns]
        axis, order = partition_axis(eqns, tuple(aval.shape))
        if axis is not None:  # the common split ``x[..., :h]``, ``x[..., h:]``
            ordered = [pieces[n] for n in order]
            value = ordered[0] if len(ordered) == 1 else lax.concatenate(ordered, axis)
        else:
            value = sharded_types.zeros(aval)
            for eqn, piece in zip(eqns, pieces):
                start = eqn.params["start_indices"]
                value = lax.dynamic_update_slice(value, piece.astype(aval.dtype), start)
        it.set([step.var], [sharded_types.cast_like(value, aval)])
        return None


def partition_axis(eqns, shape):
    """``(axis, order)`` when the slices split ``shape`` along one axis, in order.

    Returns ``(None, None)`` when they overlap or cut along several axes.
    """
    bounds, axes = [], set()
    for n, eqn in enumerate(eqns):
        start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
        cut = [d for d in range(len(shape)) if (start[d], limit[d]) != (0, shape[d])]
        if len(cut) > 1:
            return None, None
        axes.update(cut)
        bounds.append((start, limit, n))
    if len(axes) > 1:
        return None, None
    if not axes:
        return 0, [bounds[0][2]]  # one slice is the whole value
    (axis,) = axes
    bounds.sort(key=lambda b: b[0][axis])
    end = 0
    for start, limit, _ in bounds:
        if start[axis] != end:
            return None, None
        end = limit[axis]
    if end != shape[axis]:
        return None, None
    return axis, [n for _, _, n in bounds]


registry.register_structural(["slice"], TileRule())
register_handler(Tile, _TileHandler())
