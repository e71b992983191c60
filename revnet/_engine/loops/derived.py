"""Derived carry leaves: a leaf the step recomputes from the rest of its new carry.

Many time-steppers carry a value that is a function of the new state: jax-md's
velocity Verlet keeps the force at the new positions, diffrax's reversible Heun
keeps the vector field at the new auxiliary state. The step overwrites that
leaf, so no output of the step determines its old value, and inversion of the
step alone is stuck. But the old value is what the *previous* step computed from
its new carry: the leaf is *derived*. Run backwards, the step before ``i``
computed it from the carry that step ``i`` reads, the constants and the previous
step's ``xs``; before the first step it is the initial carry's, kept by the
forward pass (one carry leaf, not one per step).

:func:`derived_leaves` finds them by a rule about the body: an inexact carry
leaf whose new value depends on the old carry only through the other new carry
leaves (and on constants and ``xs``), by effect-free equations.
:func:`with_derived` writes the body the backward pass inverts: the body's own
equations, plus the previous step's equations for each derived leaf, read from
the carry being rebuilt, and one equation tying the leaf's input to them::

    zero_k = carry_k - stop_gradient(where(first, init_k, G_k(carry, consts, xs_prev)))

whose output is known to be zero. The inversion solves ``carry_k`` from it once
the leaves ``G_k`` reads are rebuilt, and the step's cotangents are those of the
body itself: ``G_k`` is behind ``stop_gradient`` (the previous step's VJP
accounts for it) and ``zero_k`` is given no cotangent. The forward pass runs
the body unchanged; rebuilding costs ``G_k`` once per step back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from revnet._engine import jaxpr as jx
from revnet._engine.cotangents import is_float_aval


@dataclasses.dataclass(frozen=True)
class Derived:
    """A loop body with its derived carry leaves tied to the previous step.

    Attributes:
      mask: per carry leaf, whether it is derived.
      jaxpr: the body to invert (:func:`with_derived`): the body's inputs, then
        the previous step's ``xs``, ``first`` (a boolean scalar: the step is
        the loop's first) and the initial value of each derived leaf; the
        body's outputs, then one output per derived leaf, known to be zero.
      n_xs: the number of the body's ``xs`` (its last inputs).
    """

    mask: tuple[bool, ...]
    jaxpr: Any
    n_xs: int

    @property
    def extra(self) -> int:
        """The number of inputs :func:`with_derived` appends."""
        return self.n_xs + 1 + self.count

    @property
    def count(self) -> int:
        """The number of derived leaves."""
        return sum(self.mask)

    def initial(self, carry: Sequence[Any]) -> list:
        """The derived leaves of ``carry`` (the initial carry's are kept)."""
        return [c for c, d in zip(carry, self.mask) if d]

    def known(self, xs_prev: Sequence[Any], first: Any, init: Sequence[Any]) -> list:
        """The values of the inputs :func:`with_derived` appends."""
        return [*xs_prev, first, *init]

    def zeros(self) -> list:
        """The values of the outputs :func:`with_derived` appends (all zero)."""
        outs = self.jaxpr.outvars[len(self.jaxpr.outvars) - self.count :]
        return [jnp.zeros(a.shape, a.dtype) for a in map(jx.aval, outs)]

    def out_cts(self) -> list:
        """The appended outputs' cotangents: none."""
        return [None] * self.count


def derived_leaves(jaxpr: Any, carry: Sequence[int]) -> list[int]:
    """The carry leaves (indices into ``carry``) that are derived.

    Args:
      jaxpr: the loop's body; its first ``len(carry)`` outputs are the new carry.
      carry: the positions of the carry's leaves among the inputs.

    Returns:
      The indices ``k`` whose new value reads the old carry only through the
      other carry leaves' new values, by equations without effects.
    """
    n = len(carry)
    outs = jaxpr.outvars[:n]
    carry_in = {id(jaxpr.invars[c]) for c in carry}
    found = [
        k
        for k, o in enumerate(outs)
        if not jx.is_literal(o)
        and id(o) not in carry_in
        and is_float_aval(jx.aval(o))
        and jnp.issubdtype(jx.aval(o).dtype, jnp.inexact)
    ]
    found = [k for k in found if _reads_only_others(jaxpr, outs, k, [k], carry_in)]
    while True:  # read through another derived leaf, it must be derived too
        keep = [k for k in found if _reads_only_others(jaxpr, outs, k, found, carry_in)]
        if keep == found:
            return found
        found = keep


def _reads_only_others(jaxpr, outs, k, derived, carry_in) -> bool:
    """Whether leaf ``k``'s new value reads no old carry leaf, given the new
    values of the leaves that are not ``derived``."""
    others = [o for j, o in enumerate(outs) if j != k and j not in derived]
    given = [o for o in others if not jx.is_literal(o)]
    cone = jx.live_equations(jaxpr.eqns, [outs[k]], given)
    produced = {id(v) for e in cone for v in e.outvars}
    if id(outs[k]) not in produced and id(outs[k]) not in {id(g) for g in given}:
        return False  # an input passed through (the old carry, a constant)
    if any(e.effects for e in cone):
        return False
    given_ids = {id(g) for g in given}
    reads = {
        id(a)
        for e in cone
        for a in e.invars
        if not jx.is_literal(a) and id(a) not in produced and id(a) not in given_ids
    }
    return not (reads & carry_in)


def inlined(jaxpr: Any) -> Any:
    """``jaxpr`` with its plain calls (``jit``: a library's jitted step) replaced
    by their bodies, their constants as literals, so that a derived leaf's
    equations can be told apart from the rest of the step's."""
    if all(jx.plain_call_jaxpr(e) is None for e in jaxpr.eqns):
        return jaxpr
    eqns: list = []
    sub: dict = {}

    def outer(a):
        return a if jx.is_literal(a) else sub.get(a, a)

    for e in jaxpr.eqns:
        if jx.plain_call_jaxpr(e) is None:
            eqns.append(e.replace(invars=[outer(a) for a in e.invars]))
            continue
        body = jx.call_body(e)
        inner = jx.Body(inlined(body.jaxpr), body.consts)
        new, outs = jx.inline_body(inner, [outer(a) for a in e.invars], e.source_info)
        eqns += new
        sub.update((v, o) for v, o in zip(e.outvars, outs) if not jx.is_dropvar(v))
    return jaxpr.replace(eqns=eqns, outvars=[outer(a) for a in jaxpr.outvars])


def with_derived(jaxpr: Any, carry: Sequence[int], derived: Sequence[int]) -> Derived:
    """The body the backward pass inverts, with the leaves ``derived`` tied to
    the previous step (see the module's docstring).

    Args:
      jaxpr: the loop's body: constants, carry, then ``xs``.
      carry: the positions of the carry's leaves among the inputs.
      derived: the indices (into ``carry``) of the derived leaves.
    """
    n, last = len(carry), max(carry)
    xs_in = list(jaxpr.invars[last + 1 :])
    outs = jaxpr.outvars[:n]
    others = [j for j in range(n) if j not in derived and not jx.is_literal(outs[j])]
    xs_prev = [jx.new_var(jx.aval(v)) for v in xs_in]
    first = jx.new_var(jx.scalar_aval(jnp.bool_))
    init = [jx.new_var(jx.aval(jaxpr.invars[carry[k]])) for k in derived]
    # The previous step's equations for the derived leaves, on this step's
    # carry (its other leaves' new values are this step's inputs) and the
    # previous step's xs.
    given = [outs[j] for j in others]
    cone = jx.live_equations(jaxpr.eqns, [outs[k] for k in derived], given)
    prev = jx.with_inputs(
        jaxpr,
        [*given, *jaxpr.invars[: carry[0]], *xs_in],
        cone,
        [outs[k] for k in derived],
    )
    atoms = [
        *[jaxpr.invars[carry[j]] for j in others],
        *jaxpr.invars[: carry[0]],
        *xs_prev,
    ]
    eqns, values = jx.inline_body(jx.Body(prev, ()), atoms, None)
    zero = []
    for k, value, start in zip(derived, values, init):
        tie, (out,) = jx.splice(
            _tie, [jaxpr.invars[carry[k]], first, start, value], None
        )
        eqns += tie
        zero.append(out)
    body = jx.with_inputs(
        jaxpr,
        [*jaxpr.invars, *xs_prev, first, *init],
        [*jaxpr.eqns, *eqns],
        [*jaxpr.outvars, *zero],
    )
    mask = tuple(k in derived for k in range(n))
    return Derived(mask, body, len(xs_in))


def _tie(leaf, first, start, value):
    return (leaf - jax.lax.stop_gradient(jnp.where(first, start, value)),)
