"""The built-in inverse rules, grouped by family and registered in one table.

Each rule solves one primitive's equation for its unknown input from its
outputs and known inputs (see :func:`revnet.register_inverse` for the calling
convention); rules that need the inputs' shapes or dtypes declare the keyword
``in_avals``. Rules are built from ``jax.lax`` functions, so they trace, jit
and vmap like any JAX code. The families follow ``jax.lax``, one module each:

* :mod:`.arithmetic`: ``add``, ``sub``, ``neg``, ``mul``, ``div`` (with
  trace-time checks refusing a constant zero factor);
* :mod:`.elementwise`: bijections ``exp``, ``log``, ``tanh``, ``erf_inv``, ...,
  ``integer_pow`` with an odd power, widening ``convert_element_type``;
  ``cumsum``;
* :mod:`.layout`: ``reshape``, ``transpose``, ``broadcast_in_dim`` adding
  unit dimensions, ``rev``, ``concatenate``, ``split``;
* :mod:`.indexing`: ``gather``, ``scatter`` and ``scatter-add`` with known
  indices that permute (``x[..., perm]``, ``z.at[perm].set(x)``), solved by
  their transposes; ``scatter-add`` solved for its operand;
* :mod:`.linalg`: ``dot_general`` with a known square matrix;
* :mod:`.collectives`: identity-like ``sharding_constraint``, ``reshard``,
  ``pvary`` (``pcast`` to varying); ``ppermute`` (the inverse permutation),
  ``all_gather`` (this device's slice), ``all_to_all`` (the exchange back).
  ``psum`` has no inverse: it is only evaluated forward, on known inputs (a
  tensor-parallel reduction inside F).

Each rule carries its term of the log-determinant
(:func:`revnet.forward_and_log_det`): ``log|f'(x)|`` for a bijection, ``log|k|``
for a known factor, ``slogdet`` of a known matrix per row, zero for sums of
known values, layout ops, permutations by index and ``cumsum``; ``all_gather`` has none.

Each family module declares its primitives where it defines their rules, one
:func:`revnet._engine.define` call a primitive with every fact revnet keeps of
it, by keyword: the inverse, the trace-time check, ``elementwise``, the
continuity class and the log-determinant term. Importing this package imports
every family, each by name. Structural rules (nested calls, ``scan``,
``select_n``, covering slices, ``shard_map``) live in the engine itself.
"""

from __future__ import annotations

from revnet._engine import InverseRuleFn
from revnet.rules import (  # noqa: F401  (each declares its primitives)
    arithmetic,
    collectives,
    elementwise,
    indexing,
    layout,
    linalg,
)

__all__ = ["InverseRuleFn"]
