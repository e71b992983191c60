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
* :mod:`.linalg`: ``dot_general`` with a known square matrix;
* :mod:`.sharding`: identity-like ``sharding_constraint``, ``reshard``,
  ``pvary`` (``pcast`` to varying); ``ppermute`` (the inverse permutation),
  ``all_gather`` (this device's slice), ``all_to_all`` (the exchange back).
  ``psum`` has no inverse: it is only evaluated forward, on known inputs (a
  tensor-parallel reduction inside F).

:data:`TABLE` lists every rule with its properties; :func:`register_all` puts
them in the engine's registry. Structural rules (nested calls, ``scan``,
``select_n``, covering slices, ``shard_map``) live in the engine itself.
"""

from __future__ import annotations

from collections.abc import Callable

from revnet._engine import InverseRuleFn, registry
from revnet.rules.arithmetic import ARITHMETIC
from revnet.rules.elementwise import (
    UNARY,
    convert_element_type,
    cumsum,
    integer_pow,
    unary,
)
from revnet.rules.layout import LAYOUT
from revnet.rules.linalg import check_dot_general, dot_general
from revnet.rules.sharding import SHARDING

# name -> (rule, trace-time check, elementwise).
TABLE: dict[str, tuple[InverseRuleFn, Callable[..., None] | None, bool]] = {
    **{name: (fn, check, True) for name, (fn, check) in ARITHMETIC.items()},
    **{name: (unary(inv), None, True) for name, inv in UNARY.items()},
    "integer_pow": (integer_pow, None, True),
    "convert_element_type": (convert_element_type, None, True),
    "cumsum": (cumsum, None, False),
    **{name: (fn, None, False) for name, fn in LAYOUT.items()},
    "dot_general": (dot_general, check_dot_general, False),
    **{name: (fn, None, False) for name, fn in SHARDING.items()},
}


def register_all() -> None:
    """Registers every rule of :data:`TABLE` in the engine's registry."""
    for name, (fn, check, elementwise) in TABLE.items():
        registry.register(name, fn, check, elementwise=elementwise)


register_all()

__all__ = [
    "ARITHMETIC",
    "LAYOUT",
    "SHARDING",
    "TABLE",
    "UNARY",
    "InverseRuleFn",
    "register_all",
]
