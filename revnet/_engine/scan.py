"""The structural rule for ``scan``, and the reversed scan that runs it backwards.

A ``scan`` whose final carry is known and whose body is invertible in its carry
(given the constants and its known ``xs``) is solved by :func:`reversed_scan`:
ONE reverse ``lax.scan`` that rebuilds each carry from the next by the body's
plan and, given cotangents, accumulates them step by step, so memory does not
grow with the number of steps. A carry that is computed forward from known
values only (``fori_loop``'s counter) is first run forward by a reduced scan
(a :class:`~revnet._engine.plan.ScanAux` step). revnet's own ``scan`` calls
:func:`reversed_scan` directly for its backward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from revnet._engine import analysis, checks, registry, select, sharding
from revnet._engine import anchors as anc
from revnet._engine import cotangents as ct
from revnet._engine import jaxpr as jx
from revnet._engine import perturbed as pb
from revnet._engine.errors import Stuck
from revnet._engine.interpreter import Handler, register_handler, run_plan
from revnet._engine.plan import Plan, Scan, ScanAux


def restrict(jaxpr: Any, out_idx: Sequence[int]) -> tuple[Any, list[int]]:
    """The part of ``jaxpr`` that computes the outputs ``out_idx``.

    Returns:
      ``(sub, in_idx)``: ``sub`` has the inputs ``in_idx`` of ``jaxpr`` (the
      ones those outputs depend on, in order) and the outputs ``out_idx``.
    """
    outs = [jaxpr.outvars[i] for i in out_idx]
    need = {v for v in outs if not jx.is_literal(v)}
    kept = []
    for e in reversed(jaxpr.eqns):
        if any(v in need for v in e.outvars if not jx.is_dropvar(v)):
            kept.append(e)
            need.update(a for a in e.invars if not jx.is_literal(a))
    in_idx = [n for n, v in enumerate(jaxpr.invars) if v in need]
    sub = jaxpr.replace(
        invars=[jaxpr.invars[n] for n in in_idx],
        outvars=outs,
        eqns=list(reversed(kept)),
        effects=jaxpr.effects,
    )
    return sub, in_idx


class ScanRule(registry.StructuralRule):
    """Runs a ``scan`` backwards, after computing forward-only carries."""

    name = "scan"

    def analyze(self, an, i, eqn, ins, outs):
        sp = jx.scan_params(eqn)
        nc, ncar = sp.num_consts, sp.num_carry
        if not all(outs[:ncar]):
            aux = _aux(an, i, sp, ins, outs)
            if aux is not None:
                return aux, [an.wiring.eqn_outs[i][k] for k in aux.carry], ()
        if not any(outs) or not an.distinct_unknowns(i, eqn, ins):
            return None
        if not all(ins[:nc]) or not all(outs[:ncar]):
            return None  # wait until the constants and the final carry are known
        known_xs, known_ys = tuple(ins[nc + ncar :]), tuple(outs[ncar:])
        nb = len(sp.body.consts)
        body_in = (True,) * (nb + nc) + (False,) * ncar + known_xs
        try:
            plan = analysis.analyze(sp.body.jaxpr, body_in, (True,) * ncar + known_ys)
        except Stuck as stuck:
            an.fail(i, eqn, "its body is not invertible in the carry", stuck.failure)
            return None
        unknown = tuple(range(nc, nc + ncar)) + tuple(
            nc + ncar + n for n, k in enumerate(known_xs) if not k
        )
        step = Scan(i, unknown, plan, known_xs, known_ys)
        return step, [an.wiring.eqn_ins[i][n] for n in unknown], (i,)

    def positionwise(self, an, i, eqn, unknown):
        # One carry, no ``ys``: the final carry maps the initial one position by
        # position when the body does (constants and ``xs`` known).
        sp = jx.scan_params(eqn)
        if sp.num_carry != 1 or unknown != sp.num_consts or len(eqn.outvars) != 1:
            return False
        known_in, target = _carry_body_inputs(sp, eqn)
        if not select.positionwise_path(sp.body.jaxpr, known_in, 0, target):
            return False
        try:
            analysis.analyze(sp.body.jaxpr, known_in, (True,))
        except Stuck:
            return False
        return True

    def solve_positionwise(self, it, i, eqn, unknown, outs):
        sp = jx.scan_params(eqn)
        known_in, _ = _carry_body_inputs(sp, eqn)
        plan = analysis.analyze(sp.body.jaxpr, known_in, (True,))
        known = [
            None if n == unknown else it.read_in(i, n) for n in range(len(eqn.invars))
        ]
        n_xs = len(eqn.invars) - sp.num_consts - 1
        ins, _ = reversed_scan(sp, plan, (True,) * n_xs, (), known, list(outs), None)
        return ins[0]


def _carry_body_inputs(sp, eqn) -> tuple[tuple[bool, ...], int]:
    """A one-carry scan body's known inputs (all but the carry), and the carry's."""
    target = len(sp.body.consts) + sp.num_consts
    n = len(sp.body.consts) + len(eqn.invars)
    return tuple(k != target for k in range(n)), target


def _aux(an, i, sp, ins, outs) -> ScanAux | None:
    nc, ncar = sp.num_consts, sp.num_carry
    carry = tuple(k for k in range(ncar) if not outs[k])
    if not all(ins[nc + k] for k in carry) or not all(ins[:nc]):
        return None
    nb = len(sp.body.consts)
    _, in_idx = restrict(sp.body.jaxpr, carry)
    allowed = set(range(nb + nc)) | {nb + nc + k for k in carry}
    allowed |= {nb + nc + ncar + n for n, k in enumerate(ins[nc + ncar :]) if k}
    if not set(in_idx) <= allowed:
        return None
    return ScanAux(i, carry, tuple(in_idx))


class _AuxHandler(Handler):
    def needs(self, it, step):
        sp = jx.scan_params(it.jaxpr.eqns[step.eqn])
        nb = len(sp.body.consts)
        ids = it.wiring.eqn_ins[step.eqn]
        return [ids[n - nb] for n in step.in_idx if n >= nb] + [
            ids[sp.num_consts + k] for k in step.carry
        ]

    def run(self, it, step, out_cts):
        i = step.eqn
        sp = jx.scan_params(it.jaxpr.eqns[i])
        nb, nc, ncar = len(sp.body.consts), sp.num_consts, sp.num_carry
        sub, _ = restrict(sp.body.jaxpr, step.carry)
        # Body input n is outer value n (body consts, then the equation's inputs).
        fixed = [n for n in step.in_idx if n < nb + nc]
        carry_in = [nb + nc + k for k in step.carry]
        xs_in = [n for n in step.in_idx if n >= nb + nc + ncar]
        outer = {
            n: sp.body.consts[n] if n < nb else it.read_in(i, n - nb)
            for n in (*fixed, *carry_in, *xs_in)
        }
        body = jx.Body(sub, ())

        def f(c, x):
            env = {n: outer[n] for n in fixed}
            env.update(zip(carry_in, c))
            env.update(zip(xs_in, x))
            return jx.eval_body(body, *[env[n] for n in step.in_idx]), None

        final, _ = jx.scan(
            f,
            [outer[n] for n in carry_in],
            [outer[n] for n in xs_in],
            length=sp.length,
            reverse=sp.reverse,
        )
        it.set([it.wiring.eqn_outs[i][k] for k in step.carry], final)
        return None


class _ScanHandler(Handler):
    fuses = True

    def known_outs(self, it, step):
        ncar = len(step.plan.known_out) - len(step.known_ys)
        known = [v is not None for v in it.wiring.eqn_outs[step.eqn]]
        return known[:ncar] + [k and y for k, y in zip(known[ncar:], step.known_ys)]

    def run(self, it, step, out_cts):
        i = step.eqn
        eqn = it.jaxpr.eqns[i]
        unknown = set(step.unknown)
        known = it.read_ins(i, unknown)
        outs = [
            it.read(v) if k else None
            for v, k in zip(it.wiring.eqn_outs[i], self.known_outs(it, step))
        ]
        ins, cts = reversed_scan(
            jx.scan_params(eqn),
            step.plan,
            step.known_xs,
            step.known_ys,
            known,
            outs,
            out_cts,
            perturbed=it.perturbed(i),
        )
        it.set([it.wiring.eqn_ins[i][n] for n in step.unknown], ins)
        return cts


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

    Returns:
      ``(rebuilt values, input cotangents or None)``: the initial carry and
      unknown ``xs``; cotangents of constants, initial carry and ``xs``. With
      anchors that have a report, the drift at each anchor is reported.
    """
    nc, ncar = sp.num_consts, sp.num_carry
    body_consts = list(sp.body.consts)
    body_jaxpr = sp.body.jaxpr
    consts = list(known[:nc])
    xs_known = [x for x, k in zip(known[nc + ncar :], known_xs) if k]
    final = list(outs[:ncar])
    ys_known = [y for y, k in zip(outs[ncar:], known_ys) if k]
    body_invars = body_jaxpr.invars[len(body_consts) :]
    carry_avals = [jx.aval(v) for v in body_invars[nc : nc + ncar]]
    const_avals = [jx.aval(v) for v in body_invars[:nc]]
    x_avals = [jx.aval(v) for v in body_invars[nc + ncar :]]
    y_avals = [jx.aval(v) for v in body_jaxpr.outvars[ncar:]]
    const_float = [ct.is_float_aval(a) for a in const_avals]
    checking = checks.enabled()
    messages: list[str] = []
    scan_kw = dict(length=sp.length, reverse=not sp.reverse, unroll=sp.unroll)
    stored = list(stored) if stored is not None else [None] * ncar
    mask = [v is not None for v in stored]
    stored = [v for v in stored if v is not None]
    nr = ncar - len(stored)  # carry leaves the plan rebuilds

    if out_cts is None:
        if anchors is not None:
            raise ValueError("reversed_scan: anchors need cotangents")

        def body(state, per):
            carry, bad = state
            x_t, y_t, s_t = per
            with checks.scope() as sc:
                vals, _ = run_plan(
                    plan,
                    body_jaxpr,
                    body_consts + consts + list(s_t) + list(x_t),
                    list(carry) + list(y_t),
                )
            carry = merge(vals[:nr], s_t, mask)
            return (carry, checks.merge(bad, sc, messages)), vals[nr:]

        (init, bad), xs_new = jx.scan(
            body,
            (final, jnp.int32(-1) if checking else None),
            (xs_known, ys_known, stored),
            **scan_kw,
        )
        checks.record_index(bad, messages)
        return list(init) + list(xs_new), None

    body_perturbed = None
    if perturbed is not None:
        nb = len(body_consts)
        p_consts, p_xs = list(perturbed[:nc]), list(perturbed[nc + ncar :])
        p_carry = pb.loop_carry(
            body_jaxpr, [False] * nb + p_consts, perturbed[nc : nc + ncar], p_xs
        )
        body_perturbed = [False] * nb + p_consts + p_carry + p_xs
    ct_ys = list(out_cts[ncar:])
    # Cotangents of ys that are absent (zero) are made per step inside the body,
    # never stacked over all steps.
    has_ct_y = [c is not None and not ct.is_float0(c) for c in ct_ys]

    def body(state, per):
        carry, ctc, ctk, bad, (i, drift) = state
        x_t, y_t, s_t, cty_present = per
        present = iter(cty_present)
        cty_t = [next(present) if h else None for h in has_ct_y]
        cts_t = [
            c if c is not None else ct.zeros(a)
            for c, a in zip(list(ctc) + cty_t, [*carry_avals, *y_avals])
        ]
        with checks.scope() as sc:
            vals, in_cts = run_plan(
                plan,
                body_jaxpr,
                body_consts + consts + list(s_t) + list(x_t),
                list(carry) + list(y_t),
                cts_t,
                body_perturbed,
            )
        bad = checks.merge(bad, sc, messages)
        in_cts = in_cts[len(body_consts) :]
        new_ctk = [
            ct.add(a, b) if f else None
            for a, b, f in zip(ctk, in_cts[:nc], const_float)
        ]
        new_ctc = ct.float_or_none(in_cts[nc : nc + ncar], carry_avals)
        x_cts = ct.float_or_none(in_cts[nc + ncar :], x_avals)
        carry = merge(vals[:nr], s_t, mask)
        if anchors is not None:
            carry, drift = anc.restore(anchors, carry, i, drift)
            i = i - 1
        return (carry, new_ctc, new_ctk, bad, (i, drift)), (vals[nr:], x_cts)

    ct_consts0 = [
        sharding.zeros(a) if f else None for a, f in zip(const_avals, const_float)
    ]
    state = (
        final,
        ct.float_or_none(out_cts[:ncar], carry_avals),
        ct_consts0,
        jnp.int32(-1) if checking else None,
        (None, None)
        if anchors is None
        else (
            jnp.int32(sp.length - 1),
            anc.start(anchors, anc.count(sp.length, anchors.every)),
        ),
    )
    (init, ct_init, ct_k, bad, (_, drift)), (xs_new, ct_xs) = jx.scan(
        body,
        state,
        (xs_known, ys_known, stored, [c for c, h in zip(ct_ys, has_ct_y) if h]),
        **scan_kw,
    )
    checks.record_index(bad, messages)
    if anchors is not None:
        anc.report(anchors, drift, anc.count(sp.length, anchors.every))
    return list(init) + list(xs_new), list(ct_k) + list(ct_init) + list(ct_xs)


def merge(rebuilt: Sequence[Any], kept: Sequence[Any], mask: Sequence[bool]) -> list:
    """A carry from its rebuilt leaves and its kept ones (``mask``: which are kept)."""
    rebuilt, kept = iter(rebuilt), iter(kept)
    return [next(kept) if m else next(rebuilt) for m in mask]


registry.register_structural(["scan"], ScanRule())
register_handler(ScanAux, _AuxHandler())
register_handler(Scan, _ScanHandler())
