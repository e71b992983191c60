"""Partitioning the blocks over a ``jax.sharding`` mesh: rules, not edits.

Two pieces, one for each kind of array a training step holds:

* **Parameters** are placed once, before training, by *partition rules*, as
  T5X, MaxText and flax's ``nn.partitioning`` do: a rule maps a regular
  expression over a Haiku parameter's path (``"module/path/param"``) to one
  logical or mesh axis name per dimension of the parameter *as one layer sees
  it*. :func:`partition` resolves logical names through ``axes`` (for example
  ``{"embed": "data", "mlp": "model"}``: FSDP over ``data``, tensor
  parallelism over ``model``) and returns ``NamedSharding``s to
  ``jax.device_put`` the parameters (and the optimiser state) with. Stacked
  parameters (a :class:`~revnet.blocks.ReversibleSequence` holds
  ``num_layers`` copies on a leading axis) get a leading ``None`` per stacking
  level, so one rule serves a layer whatever the depth.

* **Activations** are constrained by the blocks' ``activation_sharding=``
  option (a ``PartitionSpec`` of the residual stream, e.g. ``P("data")``),
  the same in every front door (``revnet/_layers/activation_sharding.py``, where
  :func:`constrain` comes from): each layer's input and output are
  constrained to it, and under Explicit mesh axes each layer runs with the
  axes Auto inside.

Sharding is not part of the invertibility analysis: ``sharding_constraint`` and
``reshard`` are identities to the core, and every value the
backward pass rebuilds, and every cotangent, carries its forward value's
sharding.

Example (8 devices as a 4 x 2 mesh)::

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    net = hk.transform(lambda x: blocks.ReversibleTransformer(
        4, 4, 64, 256, activation_sharding=P("data"))(x, True))
    params = jax.jit(net.init, static_argnums=2)(key, x, True)
    shardings = blocks.partition(params, mesh, blocks.TRANSFORMER_RULES,
                                 axes={"embed": "data", "heads": "model",
                                       "mlp": "model"})
    params = jax.device_put(params, shardings)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from revnet._layers.activation_sharding import constrain

__all__ = [
    "REVNET_RULES",
    "TRANSFORMER_RULES",
    "constrain",
    "partition",
    "replicated_in_auto_axes",
]

Rule = tuple[str, Any]

# Logical axis names of the parameters of revnet's own models. Give their
# mesh axes to `partition` as `axes`; names left out of `axes` are replicated.
TRANSFORMER_RULES: tuple[Rule, ...] = (
    (r"multi_head_attention/(query|key|value)/w$", ("embed", "heads")),
    (r"multi_head_attention/(query|key|value)/b$", ("heads",)),
    (r"multi_head_attention/linear/w$", ("heads", "embed")),
    (r"/g/linear/w$", ("embed", "mlp")),
    (r"/g/linear/b$", ("mlp",)),
    (r"/g/linear_1/w$", ("mlp", "embed")),
    (r".*", ()),  # layer norms and output biases: replicated
)
"""Partition rules of :class:`~revnet.blocks.ReversibleTransformer`.

Logical axes: ``"embed"`` (a half of the model width), ``"heads"`` (attention
heads times head size) and ``"mlp"`` (the MLP's hidden width). Megatron-style
tensor parallelism is ``{"heads": "model", "mlp": "model"}``; adding
``"embed": "data"`` shards the rest FSDP-style over the data axis.
"""

REVNET_RULES: tuple[Rule, ...] = (
    (r"/stage_\d+/.*/conv_\d/w$", (None, None, "conv_in", "conv_out")),
    (r"/stage_\d+/.*/conv_\d/b$", ("conv_out",)),
    (r".*", ()),  # BatchNorms, the first conv, transitions, head: replicated
)
"""Partition rules of :class:`~revnet.blocks.RevNet`.

Logical axes: ``"conv_in"`` and ``"conv_out"``, the input and output channels
of the convolutions inside the reversible stages. The first convolution, the
stage transitions and the classifier are replicated: they run outside the
stages' ``activation_sharding`` as plain Haiku code, where an Explicit mesh
refuses a convolution whose weights are sharded on a contracted axis.
"""


def _path(key_path: Any) -> str:
    """A Haiku parameter's path, ``"module/path/param"``."""
    return "/".join(str(getattr(k, "key", k)) for k in key_path)


def _stacking_axes(path: str) -> int:
    """How many leading layer axes a parameter has: one per stacked
    :class:`~revnet.blocks.ReversibleSequence` on its path (``.../~/layers/...``)."""
    return path.count("~/layers/")


def _resolve(
    logical: tuple, axes: Mapping[str, Any] | None, where: str
) -> tuple[Any, ...]:
    """Logical names to mesh axis names (or None), one entry per dimension."""
    if axes is None:
        return logical
    out = []
    for name in logical:
        if name is None:
            out.append(None)
        elif isinstance(name, str):
            out.append(axes.get(name))
        else:
            raise TypeError(
                f"partition: {where}: a logical axis must be a string or None, "
                f"got {name!r}."
            )
    return tuple(out)


def _axis_size(mesh: Mesh, entry: Any) -> int:
    names = entry if isinstance(entry, tuple) else (entry,)
    size = 1
    for name in names:
        size *= mesh.shape[name]
    return size


def partition(
    params: Any,
    mesh: Mesh,
    rules: Sequence[Rule],
    *,
    axes: Mapping[str, Any] | None = None,
) -> Any:
    """The ``NamedSharding`` of every parameter, from partition rules.

    Each leaf's path ``"module/path/param"`` (for example
    ``"reversible_transformer/~/layers/~/layers/additive_coupling/~/g/linear/w"``)
    is matched with ``re.search`` against the rules in order; the first match
    gives the leaf's spec. A spec names every dimension of the parameter as
    ONE layer sees it (``("embed", "mlp")`` for a linear layer's ``w``);
    dimensions the leaf has in front of those (the ``num_layers`` axis of a
    stacked :class:`~revnet.blocks.ReversibleSequence`, one per nesting level)
    get ``None``. An empty spec ``()`` replicates a leaf of any rank. A spec
    with fewer entries than one layer's parameter has dimensions is refused
    (a stacked leaf is recognised by its path: each ``~/layers/`` on it is one
    leading layer axis).

    Args:
      params: A Haiku parameter tree (or any tree of arrays or
        ``jax.ShapeDtypeStruct``s keyed the same way, such as an optimiser's
        state for those parameters).
      mesh: The mesh to place the parameters on.
      rules: ``(pattern, spec)`` pairs; ``spec`` is a ``PartitionSpec`` or a
        tuple of axis names (mesh axis names, or logical names when ``axes``
        is given), ``None`` for a replicated dimension.
      axes: Optional mapping from logical axis names to mesh axis names (a
        name, a tuple of names, or None). Logical names it leaves out are
        replicated.

    Returns:
      A tree of ``jax.sharding.NamedSharding`` shaped like ``params``.

    Raises:
      ValueError: If a leaf matches no rule (add ``(".*", ())`` to replicate
        the rest), a spec has more entries than the leaf has dimensions or
        fewer than one layer's parameter has,
        names an axis the mesh lacks or one twice, or a sharded dimension is
        not divisible by its mesh axes' size.
      TypeError: If a rule is not a ``(pattern, spec)`` pair.
    """
    compiled = []
    for rule in rules:
        if not (isinstance(rule, tuple) and len(rule) == 2):
            raise TypeError(f"partition: a rule must be (pattern, spec), got {rule!r}.")
        pattern, spec = rule
        compiled.append((re.compile(pattern), pattern, tuple(spec)))

    def place(key_path: Any, leaf: Any) -> NamedSharding:
        path = _path(key_path)
        match = next((r for r in compiled if r[0].search(path)), None)
        if match is None:
            raise ValueError(
                f"partition: no rule matches {path!r} (shape {tuple(leaf.shape)}); "
                "add a rule such as ('.*', ()) to replicate the remaining leaves."
            )
        _, pattern, spec = match
        where = f"rule {pattern!r} for {path!r} of shape {tuple(leaf.shape)}"
        spec = _resolve(spec, axes, where)
        ndim = len(leaf.shape)
        if spec and len(spec) > ndim:
            raise ValueError(
                f"partition: {where}: the spec {spec} has {len(spec)} entries, "
                f"more than the leaf's {ndim} dimensions."
            )
        per_layer = ndim - _stacking_axes(path)
        if spec and len(spec) < per_layer:
            raise ValueError(
                f"partition: {where}: the spec {spec} has {len(spec)} entries, fewer "
                f"than the {per_layer} dimensions of one layer's parameter; name "
                "each of them (None for a replicated one)."
            )
        full = (None,) * (ndim - len(spec)) + spec if spec else ()
        used = [
            n
            for e in full
            if e is not None
            for n in (e if isinstance(e, tuple) else (e,))
        ]
        for name in used:
            if name not in mesh.shape:
                raise ValueError(
                    f"partition: {where}: the mesh has no axis {name!r} (its axes: "
                    f"{tuple(mesh.axis_names)})."
                )
        if len(set(used)) != len(used):
            raise ValueError(f"partition: {where}: {full} uses a mesh axis twice.")
        for dim, entry in zip(leaf.shape, full):
            if entry is not None and dim % _axis_size(mesh, entry):
                raise ValueError(
                    f"partition: {where}: dimension {dim} is not divisible by the "
                    f"size {_axis_size(mesh, entry)} of mesh axes {entry!r}."
                )
        return NamedSharding(mesh, PartitionSpec(*full))

    return jax.tree_util.tree_map_with_path(place, params)


def replicated_in_auto_axes(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run with the current mesh's Explicit axes Auto, its outputs
    replicated; ``fn`` itself when no Explicit mesh is set.

    For the stacked init of a :class:`~revnet.blocks.ReversibleSequence`: a
    ``vmap`` over layers of Haiku code merges the layer axis into a batch
    sharded over an Explicit axis (a convolution's reshape), which Explicit
    axes refuse; the parameters are placed afterwards by :func:`partition`.
    """

    def run(*args: Any) -> Any:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh is None or mesh.empty or not mesh._any_axis_explicit:
            return fn(*args)
        auto = mesh.update_axis_types({n: AxisType.Auto for n in mesh.axis_names})
        with jax.sharding.use_abstract_mesh(auto):
            args = jax.sharding.reshard(args, PartitionSpec())
            out = fn(*args)
        return jax.sharding.reshard(out, PartitionSpec())

    return run
