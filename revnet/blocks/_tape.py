"""Recording a block's invertible steps, and running them backwards.

Each invertible module (a coupling, a squeeze, a permutation) is described by a
*rule*: three pure functions of explicit parameters ``params`` (differentiated)
and ``aux`` (state and RNG keys, not differentiated)::

    forward(params, aux, x) -> (y, new_state)
    inverse(params, aux, y) -> x
    backward(params, aux, y, dy) -> (x, dx, dparams)   # fused inverse + VJP

A block function such as ``lambda x: Permute()(AffineCoupling(net)(x))`` calls
its modules in forward order, but its backward pass must visit them in reverse.
So :func:`trace` runs the block once in *recording* mode on a placeholder: every
module then appends a :class:`Step` (its rule, with the parameters, state and
keys it would have used) instead of computing anything, and returns a
placeholder for its output. :func:`fused_backward` then runs the recorded steps
in reverse. Parameter gradients are mapped back to the block's parameter tree
with the VJP of the recording itself, which only selects leaves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import jax


class Rule(Protocol):
    """The pure functions describing one invertible operation."""

    def forward(self, params: Any, aux: Any, x: jax.Array) -> tuple[jax.Array, Any]:
        """Returns the output and the new state."""

    def inverse(self, params: Any, aux: Any, y: jax.Array) -> jax.Array:
        """Returns the input rebuilt from the output."""

    def backward(
        self, params: Any, aux: Any, y: jax.Array, dy: jax.Array
    ) -> tuple[jax.Array, jax.Array, Any]:
        """Returns the rebuilt input, its cotangent and the parameter cotangent."""


class Placeholder:
    """Stands in for an array while a block is being recorded."""

    def __init__(self, shape: Sequence[int], dtype: Any):
        self.shape = tuple(shape)
        self.dtype = jax.numpy.dtype(dtype)
        self.ndim = len(self.shape)

    def __repr__(self) -> str:
        return f"Placeholder({self.shape}, {self.dtype})"


@dataclasses.dataclass(frozen=True)
class Step:
    """One recorded invertible operation."""

    rule: Rule
    params: Any
    aux: Any


class _State(threading.local):
    tape: list[tuple[Step, Placeholder, Placeholder]] | None = None


_STATE = _State()


def is_recording() -> bool:
    """Whether modules should record a step instead of computing."""
    return _STATE.tape is not None


def emit(
    rule: Rule, params: Any, aux: Any, x: Any, out_shape: Sequence[int] | None = None
) -> Placeholder:
    """Records a step applied to placeholder ``x``; returns its output placeholder."""
    tape = _STATE.tape
    expected = tape[-1][2] if tape else None
    if not isinstance(x, Placeholder) or (expected is not None and x is not expected):
        raise ValueError(
            "A reversible block must be a chain of revnet invertible modules "
            "(AdditiveCoupling, AffineCoupling, Squeeze, ChannelPermutation, ...), "
            "each applied to the previous one's output; other computation between "
            "them cannot be inverted."
        )
    shape = x.shape if out_shape is None else tuple(out_shape)
    out = Placeholder(shape, x.dtype)
    tape.append((Step(rule, params, aux), x, out))
    return out


@contextlib.contextmanager
def _recording() -> Iterator[list]:
    previous, _STATE.tape = _STATE.tape, []
    try:
        yield _STATE.tape
    finally:
        _STATE.tape = previous


def trace(block: Callable[[Any], Any], x_spec: jax.ShapeDtypeStruct) -> list[Step]:
    """Records the steps of ``block`` applied to an input shaped like ``x_spec``.

    Args:
      block: Calls a Haiku ``apply`` on its single argument.
      x_spec: Shape and dtype of the block's input.

    Returns:
      The block's steps in forward order.

    Raises:
      ValueError: If the block does anything but chain invertible modules.
    """
    x = Placeholder(x_spec.shape, x_spec.dtype)
    with _recording() as tape:
        try:
            out = block(x)
        except (TypeError, AttributeError) as e:
            raise ValueError(
                "A reversible block must be a chain of revnet invertible modules; "
                f"computing on its input failed with: {e}"
            ) from e
    expected = tape[-1][2] if tape else x
    if out is not expected:
        raise ValueError(
            "A reversible block must return the output of its last invertible "
            f"module, got {out!r}."
        )
    return [step for step, _, _ in tape]


def inverse(steps: Sequence[Step], y: jax.Array) -> jax.Array:
    """Runs recorded steps backwards, rebuilding the block input from ``y``."""
    for step in reversed(steps):
        y = step.rule.inverse(step.params, step.aux, y)
    return y


def fused_backward(
    record: Callable[[Any], list[Step]], params: Any, y: jax.Array, dy: jax.Array
) -> tuple[jax.Array, jax.Array, Any]:
    """Rebuilds a block's input and computes its cotangents in one reverse pass.

    Args:
      record: Maps the block's parameters to its recorded steps (see
        :func:`trace`).
      params: The block's parameters.
      y: The block's output.
      dy: The cotangent of the output.

    Returns:
      ``(x, dx, dparams)``: the rebuilt input, and the cotangents of the input
      and of ``params``.
    """
    rules = []

    def collect(p):
        steps = record(p)
        rules[:] = [s.rule for s in steps]
        return [s.params for s in steps], [s.aux for s in steps]

    step_params, pullback, auxes = jax.vjp(collect, params, has_aux=True)
    grads = [None] * len(rules)
    for i in reversed(range(len(rules))):
        y, dy, grads[i] = rules[i].backward(step_params[i], auxes[i], y, dy)
    (dparams,) = pullback(grads)
    return y, dy, dparams
