"""Masked couplings: an unknown known on a mask's positions from an output.

RealNVP with a binary mask ``m`` writes its coupling as one expression of
the whole input ``u``:

    y = u * m + (1 - m) * (u * exp(s(u * m)) + t(u * m))
    y = where(m, u, u * exp(s(where(m, u, 0))) + t(where(m, u, 0)))

Propagation is stuck there: ``u`` is read both as itself and through the
conditioner. Yet where ``m`` holds, ``y`` is ``u``; so the masked input
``u * m`` (or ``where(m, u, 0)``), which is all the conditioner reads, is
``y * m``: known. With it known, ``y`` is an elementwise affine map of ``u``,
which the analysis solves.

When stuck, :func:`solve_masked` looks for a known output ``y`` that equals
an unknown input ``u`` where a known mask holds, proved on the program: the
equations from ``u`` to ``y`` keep ``u`` where the mask holds (``u * m``, a
select on the mask picking ``u``, sums of such terms) and make zero there in
every other term (a factor ``1 - m``). The mask products of ``u`` read outside
that proof (by the conditioner) are made inputs of a copy of the program,
known, and the copy is analysed. The step computes the mask products from
``y`` and runs the copy's plan; its log-determinant is the copy's (the
Jacobian is triangular: the conditioner reads only the positions the mask
passes through).

A float mask is checked at run time to hold only zeros and ones (the plan is
cached by structure and holds for every binary mask); a boolean one needs no
check.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import jax.numpy as jnp

from revnet._engine import jaxpr as jx
from revnet._engine import log_det, mask_proof, runtime_checks
from revnet._engine.errors import Stuck
from revnet._engine.interpreter import (
    Handler,
    apply_eqn,
    register_handler,
    run_cone,
    run_plan,
)
from revnet._engine.linear_forms import is_inexact


@dataclasses.dataclass(frozen=True)
class Masked:
    """The unknown ``var`` solved through the mask products of it.

    Attributes:
      var: the unknown equal to ``given`` where the mask holds.
      given: the known value.
      eqn: the equation making ``given`` (named in messages).
      cone: the equations from ``var`` to ``given``, in order.
      reads: the known values the cone reads besides ``var``.
      products: ``(equation, position of var)`` of each mask product rewired.
      uses: per product, the ``(equation, input position)`` in the cone
        reading it outside the proof, which read a known input instead.
      mask: the mask (a float one is checked at run time to be binary).
      zeros: known values checked at run time to be zero (False) where the
        mask holds.
      plan: the plan of the cone (:func:`local`).
      produced: ``var`` and the cone's values not known yet, evaluated
        forward from it.
    """

    var: int
    given: int
    eqn: int
    cone: tuple[int, ...]
    reads: tuple[int, ...]
    products: tuple[tuple[int, int], ...]
    uses: tuple[tuple[tuple[int, int], ...], ...]
    mask: int
    zeros: tuple[int, ...]
    plan: Any
    produced: tuple[int, ...]


def solve_masked(an: Any, analyze: Any) -> tuple[Masked, list[int]] | None:
    """A step solving an unknown of the stuck analysis ``an`` through a mask,
    and the values it produces; None when there is none.
    ``analyze(jaxpr, known_in, known_out)`` plans the cone's program."""
    try:
        return _solve_masked(an, analyze)
    except RecursionError:  # a sum deeper than Python's stack: not solved
        return None


def _solve_masked(an: Any, analyze: Any) -> tuple[Masked, list[int]] | None:
    for i in range(len(an.jaxpr.eqns)):
        outs = an.wiring.eqn_outs[i]
        if an.done[i] or len(outs) != 1 or not an.is_known(outs[0]):
            continue
        (y,) = outs
        if all(an.ins_known(i)) or not is_inexact(an.avals[y]):
            continue
        for loose, mask in itertools.product((False, True), mask_proof.masks(an)):
            pr = mask_proof.Proof()
            if not isinstance(mask_proof.restrict(an, y, mask, pr, loose), int):
                continue
            # The unknowns equal to y where the mask holds, nearest first (a
            # second coupling on the same mask passes the first's input on).
            for u in reversed(pr.same):
                if u == y or an.is_known(u):
                    continue
                step = _step(an, analyze, y, u, mask, pr.eqns, pr.zeros)
                if step is not None:
                    return step, list(step.produced)
    return None


def _step(an, analyze, y, u, mask, proof, zeros) -> Masked | None:
    cone = _cone(an, u, y)
    made = {v for i in cone for v in an.wiring.eqn_outs[i] if v is not None}
    reads = sorted(
        {v for i in cone for v in an.wiring.eqn_ins[i] if v is not None} - made - {u}
    )
    if any(not an.is_known(v) for v in reads):
        return None
    products, uses = [], []
    for i in cone:
        pos = mask_proof.product(an, i, u, mask)
        if pos is None:
            continue
        (p,) = an.wiring.eqn_outs[i]
        outside = tuple(
            (j, n)
            for j in an.consumers.get(p, ())
            if j in cone and j not in proof
            for n, v in enumerate(an.wiring.eqn_ins[j])
            if v == p
        )
        if outside:
            products.append((i, pos))
            uses.append(outside)
    if not products:
        return None
    step = Masked(
        u,
        y,
        an.eqn_of[y],
        cone,
        tuple(reads),
        tuple(products),
        tuple(uses),
        mask,
        tuple(sorted(zeros)),
        None,
        (),
    )
    program = local(an.jaxpr, an.wiring, step)
    known_in = (False, *[True] * (len(reads) + len(products)))
    try:
        plan = analyze(program, known_in, (True,))
    except Stuck:
        return None
    produced = tuple(v for v in [u, *sorted(made)] if not an.is_known(v))
    return dataclasses.replace(step, plan=plan, produced=produced)


def _cone(an: Any, u: int, y: int) -> tuple[int, ...]:
    """The equations on a path from ``u`` to ``y``, in order."""
    ahead, todo = set(), [u]
    while todo:
        for j in an.consumers.get(todo.pop(), ()):
            if j not in ahead:
                ahead.add(j)
                todo.extend(v for v in an.wiring.eqn_outs[j] if v is not None)
    behind, todo = set(), [y]
    while todo:
        i = an.eqn_of.get(todo.pop())
        if i is not None and i in ahead and i not in behind:
            behind.add(i)
            todo.extend(v for v in an.wiring.eqn_ins[i] if v is not None)
    return tuple(sorted(behind))


def local(jaxpr: Any, w: Any, step: Masked) -> Any:
    """The cone as a program: ``(var, *reads, *products) -> given``, each
    product's uses outside the proof reading its input."""
    var = _variables(jaxpr, w)
    eqns = {i: jaxpr.eqns[i] for i in step.cone}
    new = []
    for (i, _), outside in zip(step.products, step.uses):
        p = jx.new_var(jx.aval(jaxpr.eqns[i].outvars[0]))
        new.append(p)
        for j, n in outside:
            ins = list(eqns[j].invars)
            ins[n] = p
            eqns[j] = eqns[j].replace(invars=ins)
    invars = [var[step.var], *[var[v] for v in step.reads], *new]
    body = [eqns[i] for i in step.cone]
    return jx.with_inputs(jaxpr, invars, body, [var[step.given]])


def _variables(jaxpr: Any, w: Any) -> dict:
    """The wiring's ids to ``jaxpr``'s variables."""
    var = dict(zip(w.invars, jaxpr.invars))
    for ids, eqn in zip(w.eqn_outs, jaxpr.eqns):
        var.update((v, o) for v, o in zip(ids, eqn.outvars) if v is not None)
    return var


# -- the step at run time ---------------------------------------------------- #


def _products(read, read_in, jaxpr, step: Masked, u_value) -> list:
    """The mask products, with ``u`` replaced by ``u_value``."""
    out = []
    for i, pos in step.products:
        eqn = jaxpr.eqns[i]
        ins = [u_value if n == pos else read_in(i, n) for n in range(len(eqn.invars))]
        out.append(apply_eqn(eqn, ins)[0])
    return out


class _MaskedHandler(Handler):
    def needs(self, it, step):
        ids = {step.given, *step.reads, step.mask, *step.zeros}
        for i, pos in step.products:
            ids |= {v for n, v in enumerate(it.wiring.eqn_ins[i]) if n != pos}
        ids.discard(None)
        ids.discard(step.var)
        return sorted(ids)

    def run(self, it, step, out_cts):
        w = it.wiring
        y = it.read(step.given)
        given = _products(it.read, it.read_in, it.jaxpr, step, y)
        reads = [it.read(v) for v in step.reads]
        program = local(it.jaxpr, w, step)
        (u,), _ = run_plan(step.plan, program, [*reads, *given], [y])
        # NaN where the conditions fail: the boundary check reports the drift.
        poison = _poison(it.read, step, y.dtype)
        runtime_checks.record([poison], [y], _NOT_BINARY)
        u = u + poison.astype(u.dtype)
        # The cone forward from the rebuilt value: solving its values
        # backwards would divide by the mask's zeros.
        env = {step.var: u, **dict(zip(step.reads, reads))}
        env = run_cone(it.jaxpr, w, step.cone, env, it.read_in)
        produced = list(step.produced)
        it.set(produced, [env[v] for v in produced])
        return None


def _poison(read, step: Masked, dtype) -> Any:
    """A scalar: NaN where the proof's run-time conditions fail (a float mask
    that is not binary, a value assumed zero where the mask holds that is
    not), else zero."""
    m = read(step.mask)
    ok = jnp.all((m == 0) | (m == 1))
    held = m.astype(bool)
    for v in step.zeros:
        z = read(v)
        ok = ok & jnp.all(jnp.where(held, z == 0, True))
    return jnp.where(ok, 0.0, jnp.nan).astype(dtype)


_NOT_BINARY = (
    "a masked coupling's mask holds values other than 0 and 1, or its "
    "complement is not zero where the mask is one: the masked input is not "
    "the output there; use a binary mask and 1 - mask (or a boolean mask "
    "with jnp.where)"
)


class _MaskedTerms(log_det.TermRule):
    """The cone's log-determinant, at the forward values."""

    def term(self, ev, step):
        program = local(ev.jaxpr, ev.wiring, step)
        products = [ev.read(ev.wiring.eqn_outs[i][0]) for i, _ in step.products]
        args = [ev.read(step.var), *[ev.read(v) for v in step.reads], *products]
        _, term = ev.nested(step.plan, program, args)
        return term + _poison(ev.read, step, jnp.result_type(term))


register_handler(Masked, _MaskedHandler())
log_det.register_term_rule(Masked, _MaskedTerms())
