"""Calling a user's Equinox module with or without ``eqx.nn.State``.

Equinox's convention: a module holding state (an ``eqx.nn.StateIndex``, as
``eqx.nn.BatchNorm`` does) is called as ``module(x, state, key=key) -> (y,
state)``; any other as ``module(x, key=key) -> y``.
"""

from __future__ import annotations

import inspect
import os
import traceback
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

from revnet._layers.precision import cast_floats, cast_like


def _is_index(leaf: Any) -> bool:
    return isinstance(leaf, eqx.nn.StateIndex)


def split_key(key: jax.Array | None, num: int) -> tuple[jax.Array | None, ...]:
    """``num`` keys drawn from ``key`` in a fixed order (None without one), so
    that an inverse, which runs ``g`` before ``f``, replays dropout."""
    return (None,) * num if key is None else tuple(jax.random.split(key, num))


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


def raised_by_revnet(e: BaseException) -> bool:
    """Whether revnet raised ``e`` (its errors name the module already)."""
    frames = traceback.extract_tb(e.__traceback__)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(root)


def traces(fn: Callable[[jax.Array], Any], x: jax.Array) -> bool:
    """Whether ``fn`` traces at ``x`` without a shape or type error."""
    try:
        jax.eval_shape(fn, x)
    except (TypeError, ValueError):
        return False
    return True


def check_takes_key(block: Any, name: str) -> None:
    """Checks that ``block(h, key=...)`` can be called: the sequence passes
    every block its key (dropout replays from it)."""
    try:
        params = inspect.signature(type(block).__call__).parameters.values()
    except (TypeError, ValueError):  # no signature to read: leave it to the call
        return
    kinds = {p.kind for p in params}
    if "key" in {p.name for p in params} or inspect.Parameter.VAR_KEYWORD in kinds:
        return
    raise TypeError(
        f"{name}: the block {type(block).__name__} must take a key= argument "
        "(the sequence passes each block its PRNG key); add key=None to its "
        "__call__."
    )
