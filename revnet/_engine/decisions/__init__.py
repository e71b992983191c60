"""Decisions: results that jump, stored by the forward pass at any depth.

The backward pass evaluates a function's equations again on *rebuilt* values,
which differ from the forward values by rounding. Most equations do not care:
their results move by as little as their inputs. A **decision** does: its
value jumps, so near a tie (``b > 0`` with ``b`` about zero, equal logits in an
``argmax``, a half-integer under ``round``, a multiple of the modulus under
``rem``) the rebuilt input can land on the other side, the gradient then
follows the branch the forward pass did not take, and the rebuilt inputs
themselves are wrong from there on. :mod:`revnet._engine.decisions.continuity` says
which equations are decisions, kinks, guards or smooth.

:func:`expose` rewrites a jaxpr so that every decision reading a rebuilt value
becomes an extra output, which the forward pass saves and the backward pass
reads instead of deciding again. What is stored depends on the decision
(:mod:`revnet._engine.decisions.replays`): a comparison's or an index's result; the
indices of ``top_k``; a ``sort``'s permutation; for any other jump (``rem``,
``reduce_precision``, a narrowing cast, a ``custom_jvp`` function whose body
decides) the equation's rebuilt inputs, at which the backward pass evaluates
it and its derivative. An equation reading a rebuilt float whose results are
all integers (``jnp.searchsorted``, ``jnp.digitize``) is stored whole.

**At any depth.** A decision inside a ``scan`` body, a ``remat``/checkpoint
body or a ``cond`` branch is stored too. The call is split in two: a
*deciding* call that returns the decisions (stacked per step for a scan), and
a *replaying* call that takes them as inputs in place of the equations that
made them. The forward pass runs both; the backward pass, which knows the
decisions, runs only the replaying call on rebuilt values. A decision inside
a ``while`` loop, whose steps are not counted, is refused in one line, as is
one inside a ``shard_map``.

A select whose cases agree where its predicate switches (``leaky_relu``,
``elu``, ``hard_tanh``) is a **kink**, and NaN/Inf tests are **guards**:
neither is stored by default. Kinks (``max``, ``min``, ``abs``, ``relu``,
``clamp``, reductions, pooling, ``cummax``) are recomputed by default, since a
stored mask per layer costs memory; with ``kinks="store"`` they are stored
too, and the backward pass differentiates them as ``jax.grad`` does at the
forward values, ties included. Kinks whose derivative is never used (under
``stop_gradient``, as the maximum inside ``jax.nn.softmax``) are not stored.

Each stored value is described by a :class:`Kept` record: what it is, which
equation and source line made it, and inside which loops.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from revnet._engine import jaxpr as jx
from revnet._engine.decisions.record import DECISION_MARK, KINK_MARK, Kept
from revnet._engine.decisions.rewrite import Pass

__all__ = [
    "DECISIONS",
    "DECISION_MARK",
    "KINKS",
    "KINK_MARK",
    "Exposed",
    "Kept",
    "expose",
    "stored_bytes",
]

DECISIONS = ("store", "recompute")
KINKS = ("recompute", "store")


@dataclasses.dataclass(frozen=True)
class Exposed:
    """A jaxpr whose stored decisions are extra outputs.

    Attributes:
      jaxpr: the rewritten jaxpr: the original outputs, then ``n`` decisions.
      n: how many decision outputs were appended (0: ``jaxpr`` is the input).
      kept: one record per appended output.
      forward: the same function for the forward pass alone, where each
        nested call that decides is one call returning its results and its
        decisions (``jaxpr`` splits it into a deciding and a replaying call,
        so that the backward pass can run the replaying one alone).
    """

    jaxpr: Any
    n: int
    kept: tuple[Kept, ...] = ()
    forward: Any = None

    @property
    def forward_jaxpr(self) -> Any:
        """The jaxpr the forward pass evaluates."""
        return self.jaxpr if self.forward is None else self.forward


def expose(
    jaxpr: Any,
    rebuilt: Sequence[bool],
    *,
    decisions: str = "store",
    kinks: str = "recompute",
    soft: bool = True,
) -> Exposed:
    """Appends the decisions that read rebuilt values to ``jaxpr``'s outputs.

    Args:
      jaxpr: an open jaxpr (constants as leading inputs).
      rebuilt: for each input, whether the backward pass rebuilds it (the
        function's arguments, a loop's carry) rather than knowing it exactly.
      decisions: ``"store"``, or ``"recompute"`` to make decisions again.
      kinks: ``"store"`` to store the branch of every kink too (also with
        ``decisions="recompute"``); with both ``"recompute"``, ``jaxpr`` is
        left as it is.
      soft: False to store the predicates of continuous selects too: a select
        on the inverted path whose predicate is not a function of the value
        its cases are rebuilt from is solved only with its predicate known
        (``where(x > 0, 2 * x, x / 2)`` of the stream is decided from the
        rebuilt ``x``). Callers retry with False when the analysis is stuck.

    Returns:
      The rewritten jaxpr, the number of appended outputs and what each is;
      with none, the very same jaxpr.

    Raises:
      ValueError: for a decision that cannot be stored where it sits (inside
        a ``while`` loop or a ``shard_map``), naming it and what to do.
    """
    if decisions == "recompute" and kinks == "recompute":
        return Exposed(jaxpr, 0)
    r = Pass(kinks == "store", soft, decisions == "store").run(jaxpr, list(rebuilt))
    if not r.extra:
        return Exposed(jaxpr, 0)
    outs = [*r.outvars, *r.extra]
    new = jx.with_outputs(jaxpr, outs, r.eqns)
    forward = jx.with_outputs(jaxpr, outs, r.fused)
    return Exposed(new, len(r.extra), tuple(r.kept), forward)


def stored_bytes(exposed: Exposed) -> int:
    """Bytes of the decisions a call of an exposed jaxpr stores."""
    outs = exposed.jaxpr.outvars[len(exposed.jaxpr.outvars) - exposed.n :]
    return sum(
        int(np.prod(jx.aval(v).shape, dtype=np.int64))
        * np.dtype(jx.aval(v).dtype).itemsize
        for v in outs
    )
