"""``shard_map``: a per-device body in its params, run in a manual-axes context."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from revnet._engine.jaxpr.atoms import JaxprEqn, struct
from revnet._engine.jaxpr.bodies import Body, as_body


@dataclasses.dataclass(frozen=True)
class ShardMapParams:
    """A ``shard_map`` equation: its per-device body and how it is mapped."""

    body: Body
    mesh: Any
    in_specs: tuple
    out_specs: tuple
    axis_names: frozenset
    check_vma: bool


def shard_map_params(eqn: JaxprEqn) -> ShardMapParams | None:
    """Describes a ``shard_map`` equation, or returns None for anything else."""
    if eqn.primitive.name != "shard_map":
        return None
    p = eqn.params
    return ShardMapParams(
        body=as_body(p["jaxpr"]),
        mesh=p["mesh"],
        in_specs=tuple(p["in_specs"]),
        out_specs=tuple(p["out_specs"]),
        axis_names=frozenset(
            p.get("newly_manual_axes", p.get("manual_axes", frozenset()))
        ),
        check_vma=bool(p.get("check_vma", p.get("check_rep", True))),
    )


def shard_map(
    sm: ShardMapParams, fun: Callable[..., Any], in_specs, out_specs
) -> Callable[..., Any]:
    """``fun`` mapped per device as the equation ``sm`` describes, with new specs."""
    return jax.shard_map(
        fun,
        mesh=sm.mesh,
        in_specs=tuple(in_specs),
        out_specs=tuple(out_specs),
        axis_names=set(sm.axis_names),
        check_vma=sm.check_vma,
    )


def within_shard_map(eqn: JaxprEqn, fn: Callable[[], Any]) -> Any:
    """``fn()`` run where ``eqn``'s body is traced: its manual mesh axes bound.

    The analysis of a ``shard_map`` body runs its rules on the body's types
    (``f32[4,8]{V:data}``) and collectives (``ppermute`` over ``data``), which
    only trace inside a ``shard_map``. JAX offers no public way to enter that
    context alone, so ``fn`` runs while a ``shard_map`` of the same mesh and
    specs that returns its inputs is traced abstractly.
    """
    sm = shard_map_params(eqn)
    box: list = []

    def body(*xs):
        box.append(fn())
        return xs

    jax.eval_shape(
        shard_map(sm, body, sm.in_specs, sm.in_specs),
        *[struct(v.aval) for v in eqn.invars],
    )
    return box[0]
