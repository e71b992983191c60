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
from revnet._engine import log_det, runtime_checks
from revnet._engine.errors import Stuck
from revnet._engine.interpreter import Handler, apply_eqn, register_handler, run_plan
from revnet._engine.linear_forms import is_inexact

_ZERO = "zero"


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
    for i in range(len(an.jaxpr.eqns)):
        outs = an.wiring.eqn_outs[i]
        if an.done[i] or len(outs) != 1 or not an.is_known(outs[0]):
            continue
        (y,) = outs
        if all(an.ins_known(i)) or not is_inexact(an.avals[y]):
            continue
        for loose, mask in itertools.product((False, True), _masks(an)):
            pr = _Proof()
            if not isinstance(_restrict(an, y, mask, pr, loose), int):
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
        pos = _product(an, i, u, mask)
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


# -- the proof --------------------------------------------------------------- #


@dataclasses.dataclass
class _Proof:
    """What a proof used: its equations, the known values it assumes zero
    where the mask holds, and the values it found equal to an unknown there
    (innermost first)."""

    eqns: set = dataclasses.field(default_factory=set)
    zeros: set = dataclasses.field(default_factory=set)
    same: list = dataclasses.field(default_factory=list)


def _masks(an: Any) -> list[int]:
    """The known values that mask an unknown one: a known operand of a ``mul``
    with an unknown one, or the known predicate of a ``select_n``."""
    found: list[int] = []
    for i, ins in enumerate(an.wiring.eqn_ins):
        name = jx.primitive_name(an.jaxpr.eqns[i])
        if name == "mul" and len(ins) == 2:
            cands = [a for a, b in (ins, ins[::-1]) if _unknown(an, b)]
        elif name == "select_n" and len(ins) == 3:
            cands = [ins[0]]
        else:
            continue
        for c in cands:
            if c is not None and an.is_known(c):
                r = _root(an, c)
                if r not in found:
                    found.append(r)
    return found


def _unknown(an: Any, v: int | None) -> bool:
    return v is not None and not an.is_known(v)


def _root(an: Any, v: int) -> int:
    """``v`` before casts (a boolean mask made a float one) and broadcasts
    that add leading axes (as NumPy broadcasts, so that the run-time check
    can compare the roots)."""
    while True:
        i = an.eqn_of.get(v)
        if i is None:
            return v
        eqn = an.jaxpr.eqns[i]
        (a, *_) = an.wiring.eqn_ins[i] or (None,)
        name = jx.primitive_name(eqn)
        if a is None or name not in ("convert_element_type", "broadcast_in_dim"):
            return v
        if name == "broadcast_in_dim":
            n_in, n_out = len(an.avals[a].shape), len(an.avals[v].shape)
            if tuple(eqn.params["broadcast_dimensions"]) != tuple(
                range(n_out - n_in, n_out)
            ):
                return v
        v = a


def _is(an: Any, v: int | None, mask: int) -> bool:
    return v is not None and _root(an, v) == mask


def _complement(an: Any, v: int | None, mask: int, zeros: set | None) -> bool:
    """Whether ``v`` is zero (False) where the mask holds: ``1 - m`` or
    ``~m`` of the mask; with ``zeros`` (not None), also any other known value,
    which then joins ``zeros`` and is checked at run time (a complement
    computed before tracing is a constant of its own)."""
    if v is None or not an.is_known(v) or _is(an, v, mask):
        return False
    i = an.eqn_of.get(_root(an, v))
    if i is not None:
        eqn, ins = an.jaxpr.eqns[i], an.wiring.eqn_ins[i]
        name = jx.primitive_name(eqn)
        if name == "not" and _is(an, ins[0], mask):
            return True
        one = eqn.invars[0] if eqn.invars else None
        if (
            name == "sub"
            and jx.is_literal(one)
            and float(jx.literal_value(one)) == 1.0
            and _is(an, ins[1], mask)
        ):
            return True
    if zeros is None:
        return False
    zeros.add(_root(an, v))
    return True


def _restrict(an, v, mask, pr: _Proof, loose=False) -> int | str | None:
    """``v`` where the mask holds: an unknown value, :data:`_ZERO`, or None
    (not shown), recorded in ``pr``.

    With ``loose``, a term of a sum beside one equal to an unknown may be
    zero by a known factor that is not the mask's complement on the
    program's face: it joins ``zeros``, checked at run time.
    """
    got = _restricted(an, v, mask, pr, loose)
    if isinstance(got, int):
        pr.same.append(v)
    return got


def _restricted(an, v, mask, pr: _Proof, loose) -> int | str | None:
    if v is None:
        return None
    i = an.eqn_of.get(v)
    if i is None:
        return None if an.is_known(v) else v
    name = jx.primitive_name(an.jaxpr.eqns[i])
    ins = an.wiring.eqn_ins[i]
    got = None
    if name == "mul" and len(ins) == 2:
        for a, b in (ins, ins[::-1]):
            if _is(an, a, mask):
                got = _restrict(an, b, mask, pr, loose)
            elif _complement(an, a, mask, None):
                got = _ZERO
            if got is not None:
                break
    elif name == "add" and len(ins) == 2:
        got = _sum(an, ins, mask, pr, loose)
    elif name == "select_n" and len(ins) == 3 and _is(an, ins[0], mask):
        got = _restrict(an, ins[2], mask, pr, loose)
    elif name == "select_n" and len(ins) == 3 and _complement(an, ins[0], mask, None):
        got = _restrict(an, ins[1], mask, pr, loose)
    if got is not None:
        pr.eqns.add(i)
        return got
    return None if an.is_known(v) else v


def _sum(an, ins, mask, pr: _Proof, loose) -> int | str | None:
    """``a + b`` where the mask holds."""
    terms = [_restrict(an, x, mask, pr, loose) for x in ins]
    if _ZERO in terms:
        return terms[1 - terms.index(_ZERO)]
    if not loose:
        return None
    for n in (0, 1):
        other = ins[1 - n]
        j = an.eqn_of.get(other)
        if not isinstance(terms[n], int) or j is None:
            continue
        if jx.primitive_name(an.jaxpr.eqns[j]) != "mul":
            continue
        factors = an.wiring.eqn_ins[j]
        if any(_complement(an, f, mask, pr.zeros) for f in factors):
            pr.eqns.add(j)
            return terms[n]
    return None


def _product(an: Any, i: int, u: int, mask: int) -> int | None:
    """The position of ``u`` in equation ``i`` when it is a mask product of
    ``u``: ``u * m`` or ``where(m, u, known)``."""
    name = jx.primitive_name(an.jaxpr.eqns[i])
    ins = an.wiring.eqn_ins[i]
    if name == "mul" and len(ins) == 2:
        for n, (a, b) in enumerate((ins, ins[::-1])):
            if a == u and _is(an, b, mask):
                return n
    if name == "select_n" and len(ins) == 3 and _is(an, ins[0], mask):
        if ins[2] == u and ins[1] is not None and an.is_known(ins[1]):
            return 2
    return None


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
        for i in step.cone:
            eqn = it.jaxpr.eqns[i]
            ins = [
                jx.literal_value(a) if v is None else env[v]
                for v, a in zip(w.eqn_ins[i], eqn.invars)
            ]
            env.update(zip(w.eqn_outs[i], apply_eqn(eqn, ins)))
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


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


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
