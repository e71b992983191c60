"""The residual stream's sharding, in every front door's ``activation_sharding=``.

A sequence given a ``PartitionSpec`` of its stream (such as ``P("data")``, on
the mesh set by ``jax.set_mesh``) or a ``NamedSharding`` constrains each
layer's input and output to it: ``with_sharding_constraint`` under Auto mesh
axes. Under **Explicit** axes (``jax.make_mesh``'s default) each layer runs
with the mesh's axes Auto inside (``jax.sharding.auto_axes``) and its output
is resharded to the spec: the frameworks' modules call ``jnp.dot`` without
``out_sharding``, which an Explicit mesh refuses on a contraction sharded on
both sides (a tensor-parallel MLP), so the compiler partitions the layer's
inside as under Auto axes, while the stream between layers keeps its Explicit
type. Sharding is not part of the invertibility analysis: the constraints are
identities to the core.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec


def _explicit(spec: Any) -> bool:
    """Whether ``spec`` is to be applied on a mesh with Explicit axes."""
    mesh = spec.mesh if isinstance(spec, NamedSharding) else None
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return False
    return any(t == AxisType.Explicit for t in mesh.axis_types)


def constrain(x: Any, spec: Any) -> Any:
    """``x`` constrained to ``spec`` on the current mesh, in either mode.

    Args:
      x: An array (or a tree of arrays).
      spec: A ``PartitionSpec`` (on the mesh set by ``jax.set_mesh``) or a
        ``NamedSharding``.

    Returns:
      ``x`` resharded to ``spec`` under Explicit mesh axes
      (``jax.sharding.reshard``), or with ``with_sharding_constraint`` under
      Auto axes or with no mesh set.
    """
    if spec is None:
        return x
    if _explicit(spec):
        return jax.sharding.reshard(x, spec)
    return jax.lax.with_sharding_constraint(x, spec)


def sharded_layer(
    layer: Callable[..., tuple[jax.Array, Any]], spec: Any
) -> Callable[..., tuple[jax.Array, Any]]:
    """``layer(params, state, key, h) -> (y, new_state)`` with ``h`` and ``y``
    constrained to ``spec``; under Explicit axes the layer runs in Auto axes.

    New state (BatchNorm statistics) leaves the layer replicated.
    """
    if spec is None:
        return layer

    def run(params, state, key, h):
        h = constrain(h, spec)
        if not _explicit(spec):
            y, new_state = layer(params, state, key, h)
            return constrain(y, spec), new_state
        replicated = jax.tree.map(lambda _: PartitionSpec(), state)
        auto = jax.sharding.auto_axes(layer, out_sharding=(spec, replicated))
        return auto(params, state, key, h)

    return run
