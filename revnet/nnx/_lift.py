"""Lifting NNX modules into pure functions of explicit state.

An NNX module is a Python object that owns its variables and mutates them
(BatchNorm statistics, the counters of the RNG streams that dropout draws
from). The core inverts and differentiates pure functions, so the front door
splits a module into ``(graphdef, params, state)`` with ``nnx.split`` (the
``nnx.Param`` variables, and everything else: ``nnx.BatchStat``, ``RngKey``,
``RngCount``, ...), and runs it as::

    apply(params, state, h) -> (out, new_state)

which merges a fresh module from ``graphdef`` inside the traced function, runs
it, and splits its updated state back out. Because the RNG state is an
explicit input, a rebuild in the backward pass that sees the same state draws
the same dropout masks; because new state is an output, the caller writes it
back into the module once (``nnx.update``), after the forward pass.

Variables in NNX's hijax mode (``nnx.var_defaults(hijax=True)``) are
references that JAX tracks as mutable objects; the core inverts pure array
programs only, so they are refused with a one-line error (:func:`check_vars`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from revnet._layers.precision import cast_floats, cast_like

Apply = Callable[[nnx.State, nnx.State, jax.Array], tuple[Any, nnx.State]]
"""``apply(params, state, h) -> (out, new_state)``, pure."""


_REFUSED = (
    "which revnet cannot invert; use NNX's default plain variables "
    "(nnx.var_defaults(hijax=False, ref=False))."
)


def check_defaults(where: str) -> None:
    """Refuses to create variables in NNX's hijax or ref mode.

    Raises:
      TypeError: If ``nnx.var_defaults()`` asks for hijax or ref variables.
    """
    defaults = nnx.var_defaults()
    if defaults.hijax or defaults.ref:
        raise TypeError(f"{where}: NNX's hijax/ref variable mode is on, {_REFUSED}")


def check_vars(where: str, module: nnx.Module) -> None:
    """Refuses hijax and ref variables, which the core cannot trace through.

    Raises:
      TypeError: If a variable of ``module`` is a hijax or ref variable.
    """
    for path, var in nnx.iter_graph(module):
        if isinstance(var, nnx.Variable) and (var.hijax or var.ref):
            name = "/".join(str(p) for p in path)
            raise TypeError(
                f"{where}: variable {name!r} is a hijax/ref variable, {_REFUSED}"
            )


def split(where: str, module: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, Any]:
    """Splits ``module`` into ``(graphdef, params, state)``.

    ``params`` holds the ``nnx.Param`` variables (what ``nnx.grad``
    differentiates by default), ``state`` every other variable.
    """
    check_vars(where, module)
    return nnx.split(module, nnx.Param, ...)


def pure(graphdef: nnx.GraphDef) -> Apply:
    """The pure function ``(params, state, h) -> (out, new_state)`` of a module.

    Args:
      graphdef: The module's structure, from :func:`split`.

    Returns:
      A function that merges a module with fresh copies of the variables
      (created under the current trace, so that the module may mutate them
      even where the values are closed over from outside), calls it on ``h``
      and returns its output with the module's new non-parameter state.
    """

    def apply(params, state, h):
        module = nnx.merge(graphdef, params, state, copy=True)
        out = module(h)
        _, _, new_state = nnx.split(module, nnx.Param, ...)
        return out, new_state

    return apply


def layer(apply: Apply) -> Callable[..., tuple[jax.Array, Any]]:
    """``apply`` as a layer of :func:`revnet._layers.stack.run_stack`.

    NNX modules draw their dropout keys from the RNG streams they hold, which
    are part of ``state``, so the stack's per-layer key slot is unused (None).
    """

    def run(params, state, key, h):
        del key
        return apply(params, state, h)

    return run


def in_dtype(fn: Callable[[jax.Array], jax.Array], dtype: Any) -> Callable:
    """``fn`` computing in ``dtype``: a residual function of a coupling.

    Its input and, for an ``nnx.Module``, its parameters are cast to ``dtype``
    and its output back to the input's dtype; the module's new state (such as
    BatchNorm statistics) is written back in the state's own dtype. Gradients
    reach the parameters through the casts, in their own dtype.
    """
    if dtype is None:
        return fn

    def run(h: jax.Array) -> jax.Array:
        if not isinstance(fn, nnx.Module):
            return fn(h.astype(dtype)).astype(h.dtype)
        graphdef, params, rest = nnx.split(fn, nnx.Param, ...)
        module = nnx.merge(graphdef, cast_floats(params, dtype), rest, copy=True)
        out = module(h.astype(dtype))
        nnx.update(fn, cast_like(nnx.split(module, nnx.Param, ...)[2], rest))
        return out.astype(h.dtype)

    return run
