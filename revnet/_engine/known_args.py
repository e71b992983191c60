"""Known arguments: the positions of a call that are given, not rebuilt.

``revnet.invertible(f, known_argnums=0)(params, x)`` closes ``f`` over
``params`` before tracing, so that they are constants of the inversion: saved
by the forward pass, differentiated like any closed-over value, and never
asked of the outputs. :func:`suggestion` finds, for a refused call, the one
argument whose saving would make it invertible (weights passed as an argument).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from revnet._engine.analysis import analyze
from revnet._engine.errors import BROKEN, Stuck, leaf_paths


def argnums(value: int | Sequence[int], where: str) -> tuple[int, ...]:
    """``known_argnums`` as a tuple of ints, or a TypeError naming ``where``."""
    seq = (value,) if isinstance(value, (int, np.integer)) else value
    try:
        items = list(seq)
    except TypeError:
        items = [None]
    if isinstance(value, bool) or not all(
        isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in items
    ):
        raise TypeError(
            f"{where}: known_argnums must be an int or a sequence of ints, got "
            f"{value!r}"
        )
    return tuple(int(i) for i in items)


def positions(known: tuple[int, ...], n: int, fname: str) -> list[int]:
    """``known`` as sorted non-negative positions among ``n`` arguments."""
    out = set()
    for i in known:
        if not -n <= i < n:
            raise TypeError(
                f"{fname}: known_argnums names argument {i}, but {fname} was called "
                f"with {n} positional argument{'s' if n != 1 else ''}"
            )
        out.add(i % n)
    if n and len(out) == n:
        raise TypeError(
            f"{fname}: known_argnums names every argument, so nothing is rebuilt: "
            "leave at least one argument to run backwards (the stream)"
        )
    return sorted(out)


def given(known_argnums: Any, args: tuple, fname: str) -> list[int]:
    """The known positions for :func:`revnet.inverse`, whose known arguments
    must be values (the inverse uses them), not ``jax.ShapeDtypeStruct``."""
    known = positions(argnums(known_argnums, "inverse"), len(args), fname)
    for i in known:
        leaves = jax.tree_util.tree_leaves(args[i])
        if any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves):
            raise TypeError(
                f"inverse of {fname}: args[{i}] is known, so the inverse uses its "
                "values: pass arrays there, not jax.ShapeDtypeStruct"
            )
    return known


def close_over(fun: Callable[..., Any], args: tuple, known: list[int]):
    """``(g, rest)``: ``g(*rest)`` is ``fun(*args)`` with the known arguments
    closed over."""
    if not known:
        return fun, args
    rest = tuple(a for i, a in enumerate(args) if i not in known)

    def g(*r):
        return fun(*merge(args, known, r))

    return g, rest


def merge(given: tuple, known: list[int], rebuilt: Sequence[Any]) -> tuple:
    """All arguments: the known ones as given, the others from ``rebuilt``."""
    it = iter(rebuilt)
    return tuple(given[i] if i in known else next(it) for i in range(len(given)))


def rebuilt_paths(args: tuple, known: list[int]) -> list[str]:
    """The name of each leaf of the rebuilt arguments, by its position in the
    call (``args[1]['x']``)."""
    return [
        p
        for i, a in enumerate(args)
        if i not in known
        for p in leaf_paths(f"args[{i}]", a)
    ]


def suggestion(
    stuck: Stuck, jaxpr: Any, n_consts: int, args: tuple, known: list[int]
) -> str | None:
    """The ``try:`` line for a refused call that one more known argument makes
    invertible, a rebuilt argument left besides it; else None. A rule that
    broke explains itself: it gets none."""
    if stuck.failure is not None and stuck.failure.deepest().rank == BROKEN:
        return None
    at = n_consts
    sizes = [
        (i, len(jax.tree_util.tree_leaves(a)))
        for i, a in enumerate(args)
        if i not in known
    ]
    total = sum(size for _, size in sizes)
    for i, size in sizes:
        known_in = [True] * n_consts + [False] * total
        known_in[at : at + size] = [True] * size
        at += size
        if size in (0, total):
            continue
        try:
            analyze(jaxpr, known_in, [True] * len(jaxpr.outvars))
        except Stuck:
            continue
        nums = sorted([*known, i])
        shown = nums[0] if len(nums) == 1 else tuple(nums)
        return (
            f"try: known_argnums={shown} if args[{i}] holds weights or conditioning "
            "rather than values rebuilt from the outputs (it is then saved like a "
            "closed-over value, and differentiated); or close over it"
        )
    return None
