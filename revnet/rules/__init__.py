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
* :mod:`.sharding`: identity-like ``sharding_constraint``, ``reshard``,
  ``pvary`` (``pcast`` to varying); ``ppermute`` (the inverse permutation),
  ``all_gather`` (this device's slice), ``all_to_all`` (the exchange back).
  ``psum`` has no inverse: it is only evaluated forward, on known inputs (a
  tensor-parallel reduction inside F).

Each rule carries its term of the log-determinant
(:func:`revnet.forward_and_log_det`): ``log|f'(x)|`` for a bijection, ``log|k|``
for a known factor, ``slogdet`` of a known matrix per row, zero for sums of
known values, layout ops, permutations by index and ``cumsum``; ``all_gather`` has none.

:data:`TABLE` lists every rule with its properties; :func:`register_all` puts
them in the engine's registry. Structural rules (nested calls, ``scan``,
``select_n``, covering slices, ``shard_map``) live in the engine itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from revnet._engine import InverseRuleFn, registry
from revnet.rules.arithmetic import ARITHMETIC
from revnet.rules.elementwise import (
    UNARY,
    convert_element_type,
    cumsum,
    integer_pow,
    integer_pow_term,
    unary,
    unary_term,
)
from revnet.rules.indexing import INDEXING
from revnet.rules.layout import LAYOUT
from revnet.rules.linalg import check_dot_general, dot_general, dot_general_term
from revnet.rules.sharding import SHARDING


def _term(ld: Callable[[Any, Any], Any] | int) -> Callable[..., Any] | int:
    return 0 if isinstance(ld, int) else unary_term(ld)


# name -> (rule, trace-time check, elementwise, log-determinant term: a
# function, 0 where the term is zero, None where there is none).
TABLE: dict[
    str,
    tuple[
        InverseRuleFn, Callable[..., None] | None, bool, Callable[..., Any] | int | None
    ],
] = {
    **{name: (fn, check, True, ld) for name, (fn, check, ld) in ARITHMETIC.items()},
    **{name: (unary(inv), None, True, _term(ld)) for name, (inv, ld) in UNARY.items()},
    "integer_pow": (integer_pow, None, True, integer_pow_term),
    "convert_element_type": (convert_element_type, None, True, 0),
    "cumsum": (cumsum, None, False, 0),
    **{name: (fn, None, False, 0) for name, fn in LAYOUT.items()},
    **{name: (fn, None, False, 0) for name, fn in INDEXING.items()},
    "dot_general": (dot_general, check_dot_general, False, dot_general_term),
    **{name: (fn, None, False, ld) for name, (fn, ld) in SHARDING.items()},
}


def register_all() -> None:
    """Registers every rule of :data:`TABLE` in the engine's registry."""
    for name, (fn, check, elementwise, log_det) in TABLE.items():
        registry.register(name, fn, check, elementwise=elementwise, log_det=log_det)


register_all()

__all__ = [
    "ARITHMETIC",
    "INDEXING",
    "LAYOUT",
    "SHARDING",
    "TABLE",
    "UNARY",
    "InverseRuleFn",
    "register_all",
]
