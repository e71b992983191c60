"""``revnet.stored``: what a differentiated function keeps for its backward pass.

In the manner of ``jax.ad_checkpoint.print_saved_residuals``,
:func:`stored` traces ``jax.vjp(f, *args)`` abstractly (``jax.eval_shape``:
no computation) while revnet's ``@invertible`` functions and loops record what
their forward passes save (:mod:`revnet._engine.decisions.residuals`), and
returns a :class:`StoredReport`: one row per saved value, with its kind,
shape, dtype, bytes, source line and reason, and whether it grows per layer or
step.

The rows are matched, one to one by shape and dtype, against the residuals
JAX's ``vjp`` really keeps; those that no revnet function saved (JAX's own
residuals, outside revnet's functions) are listed as ``"other"``. A revnet
call inside an enclosing ``vmap`` or ``lax.scan`` records its values per
call, while JAX keeps them batched or stacked: such a row is matched to the
residual with the added axes, whose shape it takes (its ``steps`` still
counts only the revnet call's own loop).

When what a function keeps grows with depth or steps, revnet also warns, when
the function is traced for differentiation: see
:class:`revnet.StoredGrowthWarning`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

import jax

from revnet._engine.decisions import residuals as saves
from revnet._engine.decisions.residuals import StoredGrowthWarning, StoredValue

__all__ = ["StoredGrowthWarning", "StoredReport", "StoredValue", "stored"]


@dataclasses.dataclass(frozen=True)
class StoredReport:
    """What a function's forward pass keeps for its backward pass.

    ``str(report)`` is a table, one row per value, grouped by the call that
    keeps it.

    Attributes:
      entries: the values, in the order the forward pass saves them: revnet's
        (:class:`StoredValue`), then JAX's other residuals (kind ``"other"``).
      total_bytes: the bytes of all of them.
      growing_bytes: the bytes of those that grow with depth or steps (their
        ``steps`` is not None: decisions stacked per step, stored carry
        leaves, anchors, ``xs`` and ``ys``).
    """

    entries: tuple[StoredValue, ...]
    total_bytes: int
    growing_bytes: int

    def by_kind(self) -> dict[str, int]:
        """Bytes per kind of value, in order of first appearance."""
        out: dict[str, int] = {}
        for e in self.entries:
            out[e.kind] = out.get(e.kind, 0) + e.nbytes
        return out

    def __str__(self) -> str:
        head = ("kind", "shape", "dtype", "bytes", "grows", "source line", "reason")
        lines = [
            f"{len(self.entries)} values kept for the backward pass: "
            f"{self.total_bytes:,} bytes ({self.growing_bytes:,} grow with steps)"
        ]
        groups: dict[str, list[StoredValue]] = {}
        for e in self.entries:
            groups.setdefault(e.kept_by, []).append(e)
        for by, entries in groups.items():
            rows = [head] + [_row(e) for e in entries]
            widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
            lines.append(f"{by}:")
            for r in rows:
                cells = [c.ljust(w) for c, w in zip(r, widths)] + [r[-1]]
                lines.append("  " + "  ".join(cells).rstrip())
        return "\n".join(lines)


def _row(e: StoredValue) -> tuple[str, ...]:
    dtype = str(getattr(e.dtype, "name", e.dtype))
    grows = f"x{e.steps} ({e.per_step:,}/step)" if e.steps else "-"
    return (
        e.kind,
        "[" + ",".join(map(str, e.shape)) + "]",
        dtype,
        f"{e.nbytes:,}",
        grows,
        _short(e.where),
        e.reason,
    )


def _short(where: str) -> str:
    """``file.py:12 (fn)`` for ``/path/to/file.py:12:5 (fn)``."""
    path, _, rest = where.partition(":")
    if not rest:
        return where
    line, _, fn = rest.partition(" ")
    return f"{os.path.basename(path)}:{line.split(':')[0]} {fn}".rstrip()


def _key(shape: Any, dtype: Any) -> tuple:
    return tuple(int(d) for d in shape), str(dtype)


def _within(inner: tuple, outer: tuple) -> bool:
    """Whether ``outer`` is ``inner`` with axes added (batched or stacked)."""
    it = iter(outer)
    return len(outer) > len(inner) and all(d in it for d in inner)


def _claim(values: list[StoredValue], residuals: list[Any]) -> list[StoredValue]:
    """``values``, each paired with one of JAX's ``residuals``, then the
    residuals no value claimed, as ``"other"``.

    A value claims a residual of its shape and dtype; one left over then
    claims a residual with added axes (JAX batches a value an enclosing
    ``vmap`` saves, and stacks one an enclosing ``lax.scan`` saves), whose
    shape it takes.
    """
    left = [_key(r.shape, r.dtype) for r in residuals]
    free = list(range(len(residuals)))
    out: list[StoredValue | None] = [None] * len(values)
    for exact in (True, False):
        for n, v in enumerate(values):
            if out[n] is not None:
                continue
            shape, dtype = _key(v.shape, v.dtype)
            for k in free:
                s, d = left[k]
                if d == dtype and (s == shape if exact else _within(shape, s)):
                    free.remove(k)
                    out[n] = dataclasses.replace(
                        v, shape=s, nbytes=saves.nbytes(s, v.dtype)
                    )
                    break
    why = "saved by JAX outside revnet's functions"
    return [o if o is not None else v for o, v in zip(out, values)] + [
        saves.StoredValue(
            saves.OTHER,
            left[k][0],
            residuals[k].dtype,
            saves.nbytes(left[k][0], residuals[k].dtype),
            "",
            why,
            "jax",
        )
        for k in free
    ]


def stored(f: Callable[..., Any], *args: Any, **kwargs: Any) -> StoredReport:
    """Lists what ``jax.vjp(f, *args)`` keeps for the backward pass.

    Traces the forward pass abstractly (``jax.eval_shape``: nothing is
    computed, and ``args`` may be ``jax.ShapeDtypeStruct``s) and reports each
    value it keeps: the outputs and closed-over constants of
    :func:`revnet.invertible` functions, their stored decisions, kinks and
    inputs at a point; the final or initial carry, stored carry leaves,
    anchors, trip count, ``xs`` and ``ys`` of :func:`revnet.scan` and
    :func:`revnet.while_loop`; and, as ``"other"``, what JAX keeps outside
    them. Every positional argument is differentiated.

    Args:
      f: the function, as it would be given to ``jax.vjp``.
      *args: its positional arguments: pytrees of arrays or
        ``jax.ShapeDtypeStruct``s.
      **kwargs: keyword arguments passed to ``f`` as they are (not
        differentiated).

    Returns:
      A :class:`StoredReport`; ``print(report)`` shows the table.

    Raises:
      NotInvertibleError: Whatever tracing ``f`` raises, this among others.
      StoredGrowthWarning: Where warnings of that class are made errors.

    Example:

    >>> import jax, jax.numpy as jnp, revnet
    >>> ws = jnp.ones((8, 4, 4))  # 8 layers
    >>> def layer(c, w):
    ...     a, b = c
    ...     a = a + jnp.where(b @ w > 0, 1.0, -1.0)  # a decision, per layer
    ...     return (a, b + jnp.tanh(a @ w)), None
    >>> @revnet.invertible
    ... def net(a, b):
    ...     return jax.lax.scan(layer, (a, b), ws)[0]
    >>> x = jnp.ones((2, 4))
    >>> report = revnet.stored(net, x, x)  # also warns: it grows with depth
    >>> for e in report.entries:
    ...     print(e.kind, e.shape, e.dtype, e.nbytes, e.steps)
    constant (8, 4, 4) float32 512 None
    output (2, 4) float32 32 None
    output (2, 4) float32 32 None
    decision (8, 2, 4) bool 64 8
    checked input (2, 4) float32 32 None
    checked input (2, 4) float32 32 None
    >>> report.total_bytes, report.growing_bytes
    (704, 64)
    """
    fun = functools.partial(f, **kwargs) if kwargs else f
    with saves.recording() as values:
        closure = jax.eval_shape(lambda *a: jax.vjp(fun, *a)[1], *args)
    entries = _claim(list(values), jax.tree_util.tree_leaves(closure))
    return StoredReport(
        tuple(entries),
        sum(e.nbytes for e in entries),
        sum(e.nbytes for e in entries if e.steps),
    )
