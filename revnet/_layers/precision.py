"""The compute dtype a ``ReversibleSequence`` hands to the couplings it stacks.

Every front door's ``ReversibleSequence(..., compute_dtype=jnp.bfloat16)``
works the same way. It cannot cast a whole block: a cast of the residual
stream to a narrower dtype loses information, so the block could not be
inverted. What can compute in the narrower dtype are the residual functions
of the couplings inside the block (``AdditiveCoupling``'s ``f`` and ``g``,
``AffineCoupling``'s ``net``), while the stream keeps its dtype. The sequence
builds its blocks inside a scope that carries the dtype (Haiku builds them at
each call, NNX and Equinox once, when the sequence is made); a coupling built
there without a ``compute_dtype`` of its own takes the scope's, and reports
that it did, so that a block with no coupling is refused instead of silently
running in the stream's dtype.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from revnet._checks import check_float_dtype


def _is_float(leaf: Any) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def cast_floats(tree: Any, dtype: Any) -> Any:
    """Casts the floating point array leaves of ``tree`` to ``dtype`` (None:
    as is); other leaves (integers, keys, a module's functions) are kept."""
    if dtype is None:
        return tree
    return jax.tree.map(lambda a: a.astype(dtype) if _is_float(a) else a, tree)


def cast_like(tree: Any, like: Any) -> Any:
    """Casts the floating point leaves of ``tree`` to the dtypes of ``like``'s,
    such as new state computed in the compute dtype back to the state's own."""

    def cast(a: Any, b: Any) -> Any:
        return a.astype(b.dtype) if _is_float(a) and _is_float(b) else a

    return jax.tree.map(cast, tree, like)


@dataclasses.dataclass
class _Scope:
    dtype: Any
    used: bool = False


_SCOPE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar(
    "revnet_compute_dtype", default=None
)


def coupling_compute_dtype(module: str, compute_dtype: Any) -> Any:
    """A coupling's compute dtype: its own, else that of the enclosing sequence.

    Raises:
      TypeError: If ``compute_dtype`` is not None or a floating point dtype.
    """
    dtype = check_float_dtype(module, "compute_dtype", compute_dtype)
    scope = _SCOPE.get()
    if scope is None:
        return dtype
    scope.used = True
    return scope.dtype if dtype is None else dtype


class ComputeDtype:
    """The compute dtype of one sequence, and whether any coupling took it.

    Args:
      dtype: None, or the dtype its couplings compute in.
    """

    def __init__(self, dtype: Any):
        self.dtype = dtype
        self.used = False

    @classmethod
    def checked(cls, module: str, compute_dtype: Any) -> ComputeDtype:
        """The compute dtype a sequence was given, checked.

        Raises:
          TypeError: If ``compute_dtype`` is not None or a floating point dtype.
        """
        return cls(check_float_dtype(module, "compute_dtype", compute_dtype))

    def scoped(self, block_fn: Callable[..., Any]) -> Callable[..., Any]:
        """``block_fn`` run in a scope whose couplings compute in the dtype."""
        if self.dtype is None:
            return block_fn

        @functools.wraps(block_fn)
        def scoped(*args: Any, **kwargs: Any) -> Any:
            scope = _Scope(self.dtype)
            token = _SCOPE.set(scope)
            try:
                return block_fn(*args, **kwargs)
            finally:
                _SCOPE.reset(token)
                self.used = self.used or scope.used

        return scoped

    def check_used(self, module: str) -> None:
        """Refuses a compute dtype that no coupling of the blocks took.

        Raises:
          ValueError: If the dtype is set and the blocks built no coupling.
        """
        if self.dtype is not None and not self.used:
            raise ValueError(
                f"{module}: compute_dtype={self.dtype.name} applies to the "
                "residual functions of the couplings (AdditiveCoupling, "
                "AffineCoupling) in the blocks, and these blocks build "
                "none; cast inside your own residual functions instead (a cast "
                "of the stream itself loses information and cannot be inverted)."
            )
