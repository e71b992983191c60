"""The invert mode: a loop run backwards, each carry rebuilt from the next.

The forward pass saves only the final carry (and ``xs``, ``ys``, the trip
count, the constants, the carry leaves :mod:`.store` keeps); the backward
pass walks back step by step, rebuilding each carry from the next by the
body's plan, fused with the body's VJP, so memory does not grow with the
number of steps. With anchors (:mod:`.anchors`) it continues from the carry
stored every ``k`` steps, so reconstruction error accumulates over at most
``k`` steps.

A scan is walked back by :func:`reversed_scan`, ONE reverse ``lax.scan``
(the structural rule of ``lax.scan``, :mod:`revnet._engine.structural.scan`, solves a
scan inside an ``@invertible`` function with it too); a while loop, whose
trip count is read at run time, by one ``lax.while_loop`` that counts it
down (:func:`_walk_back`). :func:`backward` picks between them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from revnet._engine import cotangents as ct
from revnet._engine import jaxpr as jx
from revnet._engine import perturbed as pb
from revnet._engine import runtime_checks, sharded_types
from revnet._engine.boundary import norms
from revnet._engine.interpreter import run_plan
from revnet._engine.loops import anchors as anc
from revnet._engine.loops.choose import Mode
from revnet._engine.loops.derived import Derived
from revnet._engine.loops.hooks import STEP_HOOKS
from revnet._engine.loops.store import merge
from revnet._engine.plan import Plan


@dataclasses.dataclass
class _Walk:
    """What both walks back over a scan read: its body, values and types."""

    sp: jx.ScanParams
    plan: Plan
    body_consts: list
    consts: list
    xs_known: list
    ys_known: list
    stored: list  # the stored carry leaves' stacked values
    mask: list  # per carry leaf: stored (True) or rebuilt by the plan
    messages: list
    derived: Derived | None = None  # the body with its derived leaves tied
    first: list = dataclasses.field(default_factory=list)  # their initial values

    @property
    def rebuilt(self) -> int:
        """How many carry leaves the plan rebuilds."""
        return len(self.mask) - len(self.stored)

    def avals(self, part: str) -> list:
        """The body's ``"consts"``, ``"carry"``, ``"xs"`` or ``"ys"`` types."""
        body = self.sp.body.jaxpr
        nc, ncar = self.sp.num_consts, self.sp.num_carry
        ins = body.invars[len(self.body_consts) :]
        vs = {
            "consts": ins[:nc],
            "carry": ins[nc : nc + ncar],
            "xs": ins[nc + ncar :],
            "ys": body.outvars[ncar:],
        }[part]
        return [jx.aval(v) for v in vs]

    def step(self, carry, y_t, s_t, x_t, cts=None, perturbed=None, t=None):
        """One step back (step ``t``, in ``xs`` order): the plan's values (and
        cotangents), checked."""
        jaxpr, known = self.sp.body.jaxpr, list(s_t) + list(x_t)
        outs, d = list(carry) + list(y_t), self.derived
        if d is not None:
            jaxpr = d.jaxpr
            known += d.known(*self._before(t), self.first)
            outs += d.zeros()
            cts = None if cts is None else list(cts) + d.out_cts()
            if perturbed is not None:
                perturbed = list(perturbed) + [False] * d.extra
        with runtime_checks.scope() as sc:
            vals, in_cts = run_plan(
                self.plan,
                jaxpr,
                self.body_consts + self.consts + known,
                outs,
                cts,
                perturbed,
            )
        if d is not None and in_cts is not None:
            in_cts = in_cts[: len(in_cts) - d.extra]
        return vals, in_cts, sc

    def _before(self, t):
        """The ``xs`` of the step the loop ran before step ``t``, and whether
        ``t`` is the loop's first step."""
        last = self.sp.length - 1
        prev = t + 1 if self.sp.reverse else t - 1
        first = (prev > last) if self.sp.reverse else (prev < 0)
        at = jnp.clip(prev, 0, max(last, 0))
        xs = [lax.dynamic_index_in_dim(x, at, keepdims=False) for x in self.xs_known]
        return xs, first

    def last(self) -> Any:
        """The index (in ``xs``) of the step the walk back starts at, counted
        in its state when leaves are derived (None otherwise)."""
        if self.derived is None:
            return None
        return jnp.int32(0 if self.sp.reverse else self.sp.length - 1)

    def before(self, t: Any) -> Any:
        """The index of the step the walk back takes after step ``t``."""
        return None if t is None else t + (1 if self.sp.reverse else -1)

    def scan(self, body, state, per):
        sp = self.sp
        kw = dict(length=sp.length, reverse=not sp.reverse, unroll=sp.unroll)
        return jx.scan(body, state, per, **kw)


def reversed_scan(
    sp: jx.ScanParams,
    plan: Plan,
    known_xs: Sequence[bool],
    known_ys: Sequence[bool],
    known: Sequence[Any],
    outs: Sequence[Any],
    out_cts: Sequence[Any] | None,
    stored: Sequence[Any] | None = None,
    anchors: anc.Anchors | None = None,
    perturbed: Sequence[bool] | None = None,
    derived: Derived | None = None,
    first: Sequence[Any] = (),
):
    """Runs a scan backwards: rebuilds its initial carry (and unknown ``xs``).

    Args:
      sp: the scan: body, numbers of constants and carries, length, direction.
      plan: the plan of the body, rebuilding the carry inputs from the carry
        outputs (and the known ``ys``), given the constants and known ``xs``.
      known_xs, known_ys: which ``xs`` and ``ys`` are known.
      known: the scan's inputs (constants, carry, xs), None where unknown.
      outs: its outputs (final carry, ys), None where unknown.
      out_cts: cotangents of the outputs, or None for values only.
      stored: for each carry leaf, None when the plan rebuilds it, or its
        value before every step, stacked (the plan reads it as known).
      anchors: carries stored every few steps (:mod:`.anchors`), from which
        the backward pass continues; with cotangents only.
      perturbed: which of the scan's inputs (constants, carry, xs) are
        differentiated; None: every float one (:mod:`.perturbed`).
      derived: None, or the body with its derived carry leaves tied to the
        previous step (:mod:`.derived`), which ``plan`` is for; every ``xs``
        is then known.
      first: the derived leaves' values in the initial carry.

    Returns:
      ``(rebuilt values, input cotangents or None)``: the initial carry and
      unknown ``xs``; cotangents of constants, initial carry and ``xs``. With
      anchors that have a report, the drift at each anchor is reported.
    """
    nc, ncar = sp.num_consts, sp.num_carry
    stored = list(stored) if stored is not None else [None] * ncar
    walk = _Walk(
        sp,
        plan,
        list(sp.body.consts),
        list(known[:nc]),
        [x for x, k in zip(known[nc + ncar :], known_xs) if k],
        [y for y, k in zip(outs[ncar:], known_ys) if k],
        [v for v in stored if v is not None],
        [v is not None for v in stored],
        [],
        derived,
        list(first),
    )
    final = list(outs[:ncar])
    if out_cts is None:
        if anchors is not None:
            raise ValueError("reversed_scan: anchors need cotangents")
        return _rebuild(walk, final), None
    return _rebuild_with_cotangents(walk, final, out_cts, anchors, perturbed)


def _rebuild(walk: _Walk, final: list) -> list:
    """The initial carry and unknown ``xs``, walking back from ``final``."""
    nr = walk.rebuilt

    def body(state, per):
        carry, bad, t = state
        x_t, y_t, s_t = per
        vals, _, sc = walk.step(carry, y_t, s_t, x_t, t=t)
        carry = merge(vals[:nr], s_t, walk.mask)
        bad = runtime_checks.merge(bad, sc, walk.messages)
        return (carry, bad, walk.before(t)), vals[nr:]

    bad0 = jnp.int32(-1) if runtime_checks.enabled() else None
    (init, bad, _), xs_new = walk.scan(
        body, (final, bad0, walk.last()), (walk.xs_known, walk.ys_known, walk.stored)
    )
    runtime_checks.record_index(bad, walk.messages)
    return list(init) + list(xs_new)


def _rebuild_with_cotangents(walk, final, out_cts, anchors, perturbed):
    """:func:`reversed_scan` with cotangents: the walk back fused with the
    body's VJP, continuing from the anchors."""
    sp, nr = walk.sp, walk.rebuilt
    nc, ncar, nb = sp.num_consts, sp.num_carry, len(walk.body_consts)
    carry_avals, y_avals = walk.avals("carry"), walk.avals("ys")
    x_avals, const_avals = walk.avals("xs"), walk.avals("consts")
    const_float = [ct.is_float_aval(a) for a in const_avals]
    body_perturbed = None
    if perturbed is not None:
        p_consts, p_xs = list(perturbed[:nc]), list(perturbed[nc + ncar :])
        p_carry = pb.loop_carry(
            sp.body.jaxpr, [False] * nb + p_consts, perturbed[nc : nc + ncar], p_xs
        )
        body_perturbed = [False] * nb + p_consts + p_carry + p_xs
    ct_ys = list(out_cts[ncar:])
    # Cotangents of ys that are absent (zero) are made per step inside the body,
    # never stacked over all steps.
    has_ct_y = [c is not None and not ct.is_float0(c) for c in ct_ys]

    def body(state, per):
        carry, ctc, ctk, bad, (i, drift), t = state
        x_t, y_t, s_t, cty_present = per
        present = iter(cty_present)
        cty_t = [next(present) if h else None for h in has_ct_y]
        cts_t = [
            c if c is not None else ct.zeros(a)
            for c, a in zip(list(ctc) + cty_t, [*carry_avals, *y_avals])
        ]
        vals, in_cts, sc = walk.step(carry, y_t, s_t, x_t, cts_t, body_perturbed, t=t)
        bad = runtime_checks.merge(bad, sc, walk.messages)
        in_cts = in_cts[nb:]
        new_ctk = [
            ct.add(a, b) if f else None
            for a, b, f in zip(ctk, in_cts[:nc], const_float)
        ]
        new_ctc = ct.float_or_none(in_cts[nc : nc + ncar], carry_avals)
        x_cts = ct.float_or_none(in_cts[nc + ncar :], x_avals)
        carry = merge(vals[:nr], s_t, walk.mask)
        if anchors is not None:
            carry, drift = anc.restore(anchors, carry, i, drift, scale)
            i = i - 1
        state = (carry, new_ctc, new_ctk, bad, (i, drift), walk.before(t))
        return state, (vals[nr:], x_cts)

    ct_consts0 = [
        sharded_types.zeros(a) if f else None for a, f in zip(const_avals, const_float)
    ]
    # Each leaf's drift is measured against its size at the end too (fields
    # that start at zero).
    scale = None if anchors is None or anchors.report is None else norms(final)
    state = (
        final,
        ct.float_or_none(out_cts[:ncar], carry_avals),
        ct_consts0,
        jnp.int32(-1) if runtime_checks.enabled() else None,
        (None, None)
        if anchors is None
        else (
            jnp.int32(sp.length - 1),
            anc.start(anchors, anc.count(sp.length, anchors.every)),
        ),
        walk.last(),
    )
    present = [c for c, h in zip(ct_ys, has_ct_y) if h]
    (init, ct_init, ct_k, bad, (_, drift), _), (xs_new, ct_xs) = walk.scan(
        body, state, (walk.xs_known, walk.ys_known, walk.stored, present)
    )
    runtime_checks.record_index(bad, walk.messages)
    if anchors is not None:
        anc.report(anchors, drift, anc.count(sp.length, anchors.every))
    return list(init) + list(xs_new), list(ct_k) + list(ct_init) + list(ct_xs)


def backward(
    sp: jx.ScanParams,
    mode: Mode,
    consts: Sequence[Any],
    xs: Sequence[Any],
    ran: Any,
    cts: tuple[Sequence[Any], Sequence[Any]],
    perturbed: tuple[Sequence[bool], Sequence[bool], Sequence[bool]],
    anchors: anc.Anchors | None,
    first: Sequence[Any] = (),
) -> tuple[list, list, list]:
    """The cotangents of a loop's constants, initial carry and ``xs``.

    Args:
      sp: the loop as a scan; ``sp.length`` is None for a while loop (its trip
        count is ``ran.steps``, read at run time).
      mode: the plan rebuilding the carry, and the leaves stored instead.
      consts, xs: the body's constants and the stacked ``xs`` (none for a
        while loop).
      ran: what the forward loop returned (:class:`.forward.Ran`).
      cts: the cotangents of the final carry and of ``ys``.
      perturbed: which constants, initial carry leaves and ``xs`` are
        differentiated.
      anchors: the stored anchors, or None.
      first: the initial carry's derived leaves (:mod:`.derived`), when
        ``mode`` has any.

    Returns:
      ``(constants, initial carry, xs)`` cotangents, None where zero.

    Example::

        ct_k, ct_c, ct_x = backward(sp, mode, consts, xs, ran, cts, flags, None)
    """
    if sp.length is None:
        p_k, p_c, _ = perturbed
        body_perturbed = list(p_k) + pb.loop_carry(sp.body.jaxpr, p_k, p_c, [])
        return _walk_back(sp, mode, consts, ran, cts[0], body_perturbed, anchors, first)
    nk, nc = sp.num_consts, sp.num_carry
    known_xs = (True,) * len(xs)
    known_ys = (True,) * (len(sp.body.jaxpr.outvars) - nc)
    with runtime_checks.scope() as top:
        _, in_cts = reversed_scan(
            sp,
            mode.plan,
            known_xs,
            known_ys,
            list(consts) + [None] * nc + list(xs),
            list(ran.final) + list(ran.ys),
            list(cts[0]) + list(cts[1]),
            merge([None] * (nc - len(ran.stored)), ran.stored, mode.stored),
            anchors,
            [*perturbed[0], *perturbed[1], *perturbed[2]],
            mode.derived,
            first,
        )
    runtime_checks.raise_if_failed(top)
    return in_cts[:nk], in_cts[nk : nk + nc], in_cts[nk + nc :]


def _walk_back(sp, mode, bk, ran, cts, perturbed, anchors, first):
    """A while loop's backward pass: ``ran.steps`` steps back from the final
    carry, in one ``lax.while_loop``; each iteration gives its remaining-step
    counter to the testing hooks in :data:`.hooks.STEP_HOOKS`."""
    body_jaxpr, nk, nc = sp.body.jaxpr, sp.num_consts, sp.num_carry
    k_avals = [jx.aval(v) for v in body_jaxpr.invars[:nk]]
    c_avals = [jx.aval(v) for v in body_jaxpr.invars[nk:]]
    # The decisions the body returns after its carry, stored per step.
    ct_decided = [ct.zeros(jx.aval(v)) for v in body_jaxpr.outvars[nc:]]
    n, bufs, hooks = ran.steps, ran.stored, tuple(STEP_HOOKS)
    d, program = mode.derived, mode.program(body_jaxpr)

    def go(state):
        return state[0] > 0

    messages: list[str] = []

    def step(state):
        m, c, ctc, ctk, bad, drift = state
        for hook in hooks:
            jax.debug.callback(hook, m)
        kept, decided = (
            [lax.dynamic_index_in_dim(b, m - 1, keepdims=False) for b in group]
            for group in (bufs, ran.ys)
        )
        outs, out_cts = list(c) + decided, list(ctc) + ct_decided
        known, flags = list(bk) + kept, perturbed
        if d is not None:
            known += d.known([], m == 1, first)
            outs, out_cts = outs + d.zeros(), out_cts + d.out_cts()
            flags = list(perturbed) + [False] * d.extra
        with runtime_checks.scope() as sc:
            prev, in_cts = run_plan(mode.plan, program, known, outs, out_cts, flags)
        bad = runtime_checks.merge(bad, sc, messages)
        in_cts = ct.float_or_none(in_cts[: nk + len(c_avals)], k_avals + c_avals)
        ctk = ct.add_into(ctk, in_cts[:nk])
        prev = merge(prev, kept, mode.stored)
        if anchors is not None:
            prev, drift = anc.restore(anchors, prev, m - 1, drift, scale)
        return m - 1, prev, in_cts[nk:], ctk, bad, drift

    scale = None if anchors is None or anchors.report is None else norms(ran.final)
    state = (
        n,
        list(ran.final),
        ct.float_or_none(list(cts), c_avals),
        ct.float_or_none([None] * nk, k_avals),
        jnp.int32(-1) if runtime_checks.enabled() else None,
        None if anchors is None else anc.start(anchors, anc.slots(anchors)),
    )
    with runtime_checks.scope() as top:
        _, _, ct_init, ct_k, bad, drift = lax.while_loop(go, step, state)
        runtime_checks.record_index(bad, messages)
    runtime_checks.raise_if_failed(top)
    if anchors is not None:
        every = anchors.every
        anc.report(anchors, drift, jnp.where(n > 0, (n - 1) // every + 1, 0))
    return ct_k, ct_init, []
