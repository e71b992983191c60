"""A memory budget for a stack: the plan that fits it, found by compiling.

Given a budget, a stack stores the most layers that fit, then recomputes
(remat) the most of the rest that fit, and inverts the others: storing is
the fastest choice, inverting the leanest. Each candidate plan is measured on
the stack's own training step, ``jax.grad`` of its output with respect to
its input and every floating point per-layer leaf, compiled and never run:
``memory_analysis()``'s arguments, outputs and temp, less what is aliased.
Memory grows about linearly with each count, so each is found by a search
that interpolates between the counts measured: a few compilations each. The
plan depends only on the program's structure and the budget, and is cached
by them. A door plans for the step that trains, not for initialisation.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from revnet._checks import fail
from revnet._layers.plan import StackPlan


@dataclasses.dataclass(frozen=True)
class Budget:
    """The memory a stack's training step may use, per device.

    Attributes:
      limit: Bytes (an integer), or a fraction in ``(0, 1]`` (a float) of the
        device's memory where the backend reports it (GPU, TPU; not CPU).

    The stack's training step is ``jax.grad`` of its output with respect to
    its input and parameters: their bytes, their gradients', and the
    compiled temp. The rest of a model (its loss, other layers, the
    optimizer) is not counted.

    Example:

    >>> revnet.Budget(64 * 2**20)
    Budget(limit=67108864)
    """

    limit: int | float

    def __post_init__(self):
        limit = self.limit
        real = isinstance(limit, numbers.Real) and not isinstance(limit, bool)
        if isinstance(limit, numbers.Integral) and real:
            if limit <= 0:
                raise fail("revnet.Budget", "limit", limit, "positive", ValueError)
            object.__setattr__(self, "limit", int(limit))
        elif real and isinstance(limit, float):
            if not 0.0 < limit <= 1.0:
                raise fail(
                    "revnet.Budget",
                    "limit",
                    limit,
                    "a whole number of bytes, or a fraction in (0, 1] of the "
                    "device's memory",
                    ValueError,
                )
        else:
            raise fail(
                "revnet.Budget",
                "limit",
                limit,
                "a number of bytes (an int) or a fraction of the device's memory "
                "(a float)",
            )

    def bytes(self, where: str) -> int:
        """The budget in bytes on this process's first device.

        Raises:
          ValueError: If the budget is a fraction and the device does not
            report its memory (CPU).
        """
        if isinstance(self.limit, int):
            return self.limit
        device = jax.devices()[0]
        stats = device.memory_stats() or {}
        total = stats.get("bytes_limit")
        if not total:
            raise ValueError(
                f"{where}: a budget of {self.limit:g} of the device's memory needs "
                f"a device that reports its memory, and {device.platform} does "
                "not; give the budget in bytes, revnet.Budget(n)."
            )
        return int(self.limit * total)


def plan_within(
    budget: int, measure: Callable[[StackPlan], int], depth: int, where: str
) -> StackPlan:
    """The plan with the most stored layers, then the most recomputed ones,
    whose step ``measure`` finds within ``budget`` bytes.

    Raises:
      ValueError: If even the plan that inverts every layer does not fit,
        giving the smallest budget that does.
    """
    known: dict[StackPlan, int] = {}

    def cost(plan: StackPlan) -> int:
        if plan not in known:
            known[plan] = measure(plan)
        return known[plan]

    smallest = cost(StackPlan())
    if smallest > budget:
        raise ValueError(
            f"{where}: a budget of {budget:,} bytes is below the smallest plan "
            f"(every layer inverted), which needs {smallest:,} bytes; give "
            f"revnet.Budget({smallest}) or more, or a smaller batch."
        )
    store = _most(lambda k: cost(StackPlan(store=k)), budget, depth)
    remat = _most(lambda m: cost(StackPlan(store, m)), budget, depth - store)
    return StackPlan(store, remat)


def _most(cost: Callable[[int], int], budget: int, high: int) -> int:
    """The largest ``n`` in ``[0, high]`` with ``cost(n) <= budget``, for a
    ``cost`` that grows with ``n`` and fits at 0: a search that guesses by
    interpolating between the nearest counts measured (memory grows about
    linearly with the number of stored layers), so a few compilations do."""
    low, high_cost = 0, cost(high)
    if high_cost <= budget:
        return high
    low_cost = cost(0)
    while high - low > 1:
        step = (budget - low_cost) * (high - low) // max(high_cost - low_cost, 1)
        guess = min(max(low + step, low + 1), high - 1)
        c = cost(guess)
        if c <= budget:
            low, low_cost = guess, c
        else:
            high, high_cost = guess, c
    return low


def step_bytes(fn: Callable[[Any, jax.Array], jax.Array], per_layer, h) -> int:
    """The bytes of ``jax.grad`` of ``sum(fn(per_layer, h))`` with respect to
    ``h`` and the floating point leaves of ``per_layer``, compiled for their
    types: arguments, outputs and temp, less what is aliased."""
    leaves, tree = jax.tree.flatten(per_layer)
    floats = [_inexact(x) for x in leaves]

    def loss(diff, rest, h):
        diff, rest = iter(diff), iter(rest)
        merged = [next(diff) if f else next(rest) for f in floats]
        y = fn(jax.tree.unflatten(tree, merged), h)
        return jnp.sum(y.astype(jnp.float32))

    grad = jax.grad(loss, (0, 2))
    types = [jax.ShapeDtypeStruct(jnp.shape(x), x.dtype) for x in leaves]
    diff = [t for t, f in zip(types, floats) if f]
    rest = [t for t, f in zip(types, floats) if not f]
    h = jax.ShapeDtypeStruct(jnp.shape(h), h.dtype)
    m = jax.jit(grad).lower(diff, rest, h).compile().memory_analysis()
    return int(
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


def _inexact(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


_PLANS: dict = {}


def cached(key: Any, find: Callable[[], StackPlan]) -> StackPlan:
    """The plan for ``key`` (the program's structure and the budget), found
    by ``find`` once."""
    if key not in _PLANS:
        _PLANS[key] = find()
    return _PLANS[key]


def structure(layer, per_layer, h) -> str:
    """The program of a stack's layer(s) at their types, as text: a key for
    the plan, which depends on nothing else."""

    def types(tree, drop: int):
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(jnp.shape(x)[drop:], x.dtype), tree
        )

    h = types(h, 0)
    if callable(layer):
        return str(jax.make_jaxpr(layer)(*types(per_layer, 1), h))
    return "\n".join(
        str(jax.make_jaxpr(fn)(*types(triple, 0), h))
        for fn, triple in zip(layer, per_layer)
    )
