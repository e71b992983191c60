"""Calling a user's Equinox module with or without ``eqx.nn.State``.

Equinox's convention: a module holding state (an ``eqx.nn.StateIndex``, as
``eqx.nn.BatchNorm`` does) is called as ``module(x, state, key=key) -> (y,
state)``; any other as ``module(x, key=key) -> y``.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax

from revnet._layers.precision import cast_floats, cast_like


def _is_index(leaf: Any) -> bool:
    return isinstance(leaf, eqx.nn.StateIndex)


def holds_state(module: Any) -> bool:
    """Whether ``module`` holds an ``eqx.nn.StateIndex`` anywhere inside."""
    return any(_is_index(x) for x in jax.tree.leaves(module, is_leaf=_is_index))


def missing_state(where: str, what: str, method: str = "__call__") -> ValueError:
    """The error for a module holding state whose ``method`` was called
    without it."""
    called = "model" if method == "__call__" else f"model.{method}"
    arg = "y" if method == "inverse" else "x"
    return ValueError(
        f"{where}: {what} holds state (such as eqx.nn.BatchNorm), but no state "
        "was given; build the model with eqx.nn.make_with_state and pass its "
        f"state: {called}({arg}, state, key=key)."
    )


def call(
    where: str,
    what: str,
    module: Any,
    h: jax.Array,
    state: eqx.nn.State | None,
    key: jax.Array | None,
) -> tuple[jax.Array, eqx.nn.State | None]:
    """``(y, new_substate)`` of ``module`` at ``h``; the substate is None for a
    module without state.

    Raises:
      ValueError: If ``module`` holds state and no ``state`` was given, or it
        returns something other than ``(y, state)`` when given state.
    """
    if not holds_state(module):
        return module(h, key=key), None
    if state is None:
        raise missing_state(where, what)
    out = module(h, state.substate(module), key=key)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise ValueError(
            f"{where}: {what} holds state, so it must return (y, state), got "
            f"{type(out).__name__}."
        )
    return out


def call_in(
    dtype: Any,
    where: str,
    what: str,
    module: Any,
    h: jax.Array,
    state: eqx.nn.State | None,
    key: jax.Array | None,
) -> tuple[jax.Array, eqx.nn.State | None]:
    """:func:`call` computing in ``dtype`` (None: as is).

    The module's floating point arrays, its state and ``h`` are cast to
    ``dtype``, the output back to ``h``'s dtype and new state to the state's
    own dtypes; gradients reach the arrays through the casts, in their own
    dtype.
    """
    if dtype is None:
        return call(where, what, module, h, state, key)
    held = state.substate(module) if state is not None and holds_state(module) else None
    y, sub = call(
        where,
        what,
        cast_floats(module, dtype),
        h.astype(dtype),
        cast_floats(held, dtype),
        key,
    )
    if sub is not None:
        sub = cast_like(sub, held)
    return y.astype(h.dtype), sub
