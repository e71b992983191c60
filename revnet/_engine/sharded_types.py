"""Sharded types: values made to carry the type of the value they stand for.

Under ``jax.sharding`` an array's type can hold more than its shape and dtype:

* with **Explicit** mesh axes (``jax.make_mesh``'s default) its sharding is
  part of its type: ``f32[16@data,8]`` is not ``f32[16,8]``;
* inside ``shard_map`` (manual axes, ``check_vma=True``) the mesh axes along
  which it *varies* are part of its type: ``f32[4,8]{V:data}``.

Under **Auto** axes a sharding is only a hint, not a type. JAX checks these
types: a custom VJP's cotangent must have its primal's type, and an equation
of a nested body must be given values of the types it was traced with. A rule
that builds a value from scratch (zeros) or in another way than the forward
pass did (an inverse) may get another type, so the engine casts every value it
rebuilds, and every cotangent it returns, with :func:`cast_like`: a
``jax.sharding.reshard`` to the Explicit sharding, a ``pcast`` to the varying
axes, and an exact all-reduce of one device's copy where a value varies along
axes its type does not. Values that already have the type are untouched, so
nothing is added to unsharded programs.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType


def varying(a: Any) -> frozenset:
    """The manual mesh axes along which a value of type ``a`` varies."""
    mat = getattr(a, "mat", getattr(a, "manual_axis_type", None))
    return frozenset(getattr(mat, "varying", ()) or ())


def explicit_spec(a: Any, ndim: int) -> tuple | None:
    """The Explicit sharding of type ``a``, one entry per dimension, or None.

    None when the type's mesh has no Explicit axis (Auto, manual or no mesh):
    the sharding is then not part of the type.
    """
    sharding = getattr(a, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty:
        return None
    if not any(t == AxisType.Explicit for t in mesh.axis_types):
        return None
    spec = tuple(sharding.spec)
    return spec + (None,) * (ndim - len(spec))


def cast_like(x: Any, a: Any) -> Any:
    """``x`` with the sharding type of the abstract value ``a``.

    Only the parts of the type that differ are changed; a value of another
    shape or dtype is returned as it is (the caller reports that).
    """
    if not hasattr(x, "shape") or tuple(x.shape) != tuple(a.shape):
        return x
    if isinstance(a, (jax.Array, jax.core.Tracer)):
        a = jax.typeof(a)
    t = jax.typeof(x)
    want, have = varying(a), varying(t)
    if have - want:
        x = _invariant(x, tuple(sorted(have - want)))
    if want - have:
        x = lax.pcast(x, tuple(sorted(want - have)), to="varying")
    mesh = _mesh(a)
    if mesh is not None and _mesh(jax.typeof(x)) not in (None, mesh):
        # Another view of the mesh (``jax.sharding.auto_axes`` makes Explicit
        # axes Auto inside): cast as auto_axes does, under the target's mesh.
        with jax.sharding.use_abstract_mesh(mesh):
            return jax.sharding.reshard(x, a.sharding.spec)
    spec = explicit_spec(a, len(a.shape))
    if spec is not None and explicit_spec(jax.typeof(x), len(a.shape)) != spec:
        x = jax.sharding.reshard(x, a.sharding)
    return x


def explicit_like(x: Any, a: Any) -> Any:
    """``x`` with the Explicit sharding of type ``a`` (a ``reshard`` where they
    differ); its varying axes untouched, and unchanged where ``a`` has none."""
    spec = explicit_spec(a, len(a.shape))
    if spec is None or explicit_spec(jax.typeof(x), len(a.shape)) == spec:
        return x
    return jax.sharding.reshard(x, a.sharding)


def _mesh(a: Any) -> Any:
    """The abstract mesh of type ``a``'s sharding, or None (no mesh)."""
    mesh = getattr(getattr(a, "sharding", None), "mesh", None)
    if mesh is None or mesh.empty:
        return None
    return getattr(mesh, "abstract_mesh", mesh)


def _invariant(x: Any, axes: tuple) -> Any:
    """A value varying along ``axes`` whose copies are equal, made invariant.

    The copy of the first device along ``axes`` is all-reduced with zeros from
    the others: exact (``x + 0 == x``), where a mean would round.
    """
    first = lax.axis_index(axes) == 0
    return lax.psum(jnp.where(first, x, jnp.zeros_like(x)), axes)


def type_key(a: Any) -> tuple:
    """The parts of type ``a`` that sharding adds: Explicit spec, varying axes.

    Types whose values sit alike on every device have equal keys: a replicated
    spec (``P()``, ``P(None, None)``, any spec of a scalar) is keyed as no
    Explicit sharding, since a value with no mesh is replicated too, and JAX
    mixes the two. Only a dimension split over mesh axes makes a difference.
    """
    spec = explicit_spec(a, len(a.shape))
    if spec is not None and not any(spec):
        spec = None
    return spec, varying(a)


def describe(a: Any) -> str:
    """The sharding part of type ``a``, in words."""
    spec, vary = explicit_spec(a, len(a.shape)), varying(a)
    text = f"P{spec}" if spec is not None else "no explicit sharding"
    return text + (f", varying along {sorted(vary)}" if vary else "")


def zeros(a: Any) -> Any:
    """Zeros of type ``a`` (shape, dtype, sharding and varying axes)."""
    return cast_like(jnp.zeros(a.shape, a.dtype), a)


def in_mesh_of(x: Any) -> Any:
    """A context manager that makes ``x``'s mesh the current abstract mesh.

    Inside ``jax.sharding.auto_axes`` values live on another view of the mesh
    (its axes Auto) than the program around it; an operation on them, such as
    adding up cotangents, must run under their view. A no-op when ``x`` has
    no mesh or the current one.
    """
    mesh = _mesh(jax.typeof(x)) if hasattr(x, "shape") else None
    if mesh is None or mesh == jax.sharding.get_abstract_mesh():
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh)


def scalar_here(x: Any) -> Any:
    """A scalar computed under another view of the mesh (``in_mesh_of``),
    replicated on the current one, so that it mixes with the program's values."""
    mesh = _mesh(jax.typeof(x))
    here = jax.sharding.get_abstract_mesh()
    if mesh is None or here is None or here.empty or mesh == here:
        return x
    return jax.sharding.reshard(x, jax.sharding.PartitionSpec())
