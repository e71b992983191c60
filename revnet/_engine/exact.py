"""Exact mode's two marks, as the engine reads them (:mod:`revnet.exact`).

:mod:`revnet.exact` rounds onto the grid ``2**-bits`` with two ``custom_jvp``
functions (straight-through derivatives) that the engine knows by name, as it
knows :func:`revnet.decision` and :func:`revnet.kink`. A ``custom_jvp`` keeps
its name under ``jax.vmap``, so the marks survive a door that vmaps its blocks.

* :data:`GRID`, ``round(x * 2**bits) * 2**-bits``: on the grid it is the
  identity, and the analysis solves it as the identity (:func:`solving_body`),
  so what is rebuilt is the rounded value.
* ``ADD:{bits}:{label}`` (:func:`add_name`), ``x + grid(d)``: the analysis
  solves its body (``x = y - grid(d)``), and :func:`guard` makes the rebuilt
  ``x`` NaN where ``|y|`` reached the exact range, where the forward sum was
  rounded; the run-time checks then name ``label``.

The decision pass stores neither (:func:`is_exact`): their inputs are rebuilt
bit for bit, so their rounding gives the forward's bits again.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from revnet._engine import jaxpr as jx
from revnet._engine import runtime_checks

GRID = "revnet_exact_grid"
ADD = "revnet_exact_add"

MANTISSA = {jnp.dtype(jnp.float32): 24, jnp.dtype(jnp.float64): 53}
"""The mantissa's bits, the implicit one included, of the dtypes exact mode
takes."""


def limit(dtype: Any, bits: int) -> float:
    """The exact range ``2**(mantissa - bits)``: sums on the grid are exact
    while their magnitude stays below it."""
    return 2.0 ** (MANTISSA[jnp.dtype(dtype)] - bits)


_LABELS: dict[str, int] = {}
_BY_INDEX: list[str] = []


def add_name(bits: int, label: str) -> str:
    """The name of an exact addition's ``custom_jvp`` on the grid ``2**-bits``
    whose run-time message calls it ``label``. A name must hold no spaces
    (JAX keeps only its first word), so it carries the label's index."""
    if label not in _LABELS:
        _LABELS[label] = len(_BY_INDEX)
        _BY_INDEX.append(label)
    return f"{ADD}:{bits}:{_LABELS[label]}"


def _name(eqn: Any) -> str:
    if jx.primitive_name(eqn) != "custom_jvp_call":
        return ""
    return jx.call_name(eqn)


def add_params(eqn: Any) -> tuple[int, str] | None:
    """``(bits, label)`` of an exact addition's equation, else None."""
    name = _name(eqn)
    if not name.startswith(ADD + ":"):
        return None
    bits, index = name[len(ADD) + 1 :].split(":", 1)
    return int(bits), _BY_INDEX[int(index)]


def is_exact(eqn: Any) -> bool:
    """Whether ``eqn`` is one of exact mode's marks."""
    return _name(eqn) == GRID or add_params(eqn) is not None


@functools.lru_cache(maxsize=64)
def _identity(shape: tuple[int, ...], dtype: Any) -> Any:
    return jax.make_jaxpr(lambda x: x)(jax.ShapeDtypeStruct(shape, dtype))


def solving_body(eqn: Any, body: Any) -> Any:
    """The body the analysis solves a call by: the identity for :data:`GRID`,
    the call's own ``body`` otherwise."""
    if body is None or _name(eqn) != GRID:
        return body
    aval = jx.aval(eqn.invars[0])
    return _identity(tuple(aval.shape), aval.dtype)


def guard(eqn: Any, outs: Sequence[Any], ins: list[Any], given: list[Any]) -> list:
    """The rebuilt inputs ``ins`` of an exact addition, NaN where its output
    ``outs[0]`` reached the exact range (recorded for the run-time checks)."""
    bits, label = add_params(eqn)
    (y,) = outs
    inside = jnp.abs(y) < limit(y.dtype, bits)
    ins = [jnp.where(inside, x, jnp.nan) for x in ins]
    runtime_checks.record(ins, given, message(label, bits, y.dtype))
    return ins


def message(label: str, bits: int, dtype: Any) -> str:
    """The run-time check's one line for an exact addition out of range."""
    name = jnp.dtype(dtype).name
    return (
        f"{label} left its exact range: |y| reached {limit(dtype, bits):g} "
        f"(2**(mantissa - exact_bits), exact_bits={bits} in {name}), where a sum "
        f"on the grid 2**-{bits} is rounded and cannot be undone; use fewer "
        "exact_bits (a coarser grid, a wider range) or keep the stream smaller "
        "(normalise the residual functions' outputs)"
    )
