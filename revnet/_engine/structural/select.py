"""The structural rule for ``select_n``.

``select_n(pred, *cases)`` (``jnp.where``) with a known predicate: each case is
inverted separately from the selected output, by a chain of *position-wise*
solves back to values common to all cases: elementwise rules (the property
recorded on each rule in the registry), structural equations whose rule's
``positionwise`` hook says so (calls and scans whose bodies are such chains),
and nested selects with a known predicate, which fork the chain. A nested
select on the outer select's own predicate (the safe ``where`` inside
``jax.nn.elu``) does not fork: it picks the same position, known predicate or
not (a flow's log-determinant reads elu's predicate, which is then stored).
Where the predicates pick a chain, its reconstruction is exact; the results
are merged with the predicates.

An unknown predicate computed from the common values alone (leaky ReLU's
``x > 0``; a nested select on that same predicate, as inside ``jax.nn.elu``,
is followed on the same side) is decided by consistency: every branch's
candidate is rebuilt, the predicate is evaluated on it, and a candidate is
kept where its own branch is picked. For an injective select that is exactly
one branch at each position. Candidates that agree to rounding are kept where
rounding put each on the other side of a continuous switch; where no branch
is consistent, or two are with different values (the select is not
injective, or the output is outside its range), the result is NaN and the
run-time checks report it.
"""

from __future__ import annotations

import jax.numpy as jnp

from revnet._engine import jaxpr as jx
from revnet._engine import log_det, registry, runtime_checks
from revnet._engine.analysis import Analysis
from revnet._engine.errors import NotInvertibleError, degenerate
from revnet._engine.interpreter import Handler, register_handler, run_cone
from revnet._engine.plan import Select
from revnet._engine.rule_check import abstract_solve


class SelectRule(registry.StructuralRule):
    name = "select_n"

    def analyze(self, an, i, eqn, ins, outs):
        if not all(outs):
            return None
        ids = an.wiring.eqn_ins[i]
        cases = list(dict.fromkeys(ids[1:]))
        if any(an.is_known(c) for c in cases):
            an.fail(
                i,
                eqn,
                "select_n with an unknown case is determined only where that case "
                "is selected",
            )
            return None
        shape = tuple(jx.aval(eqn.outvars[0]).shape)
        branches, reached = [], []
        for case in cases:
            same = (ids[0], ids.index(case, 1))
            for chain, local in _chain_to(an, case, shape, same):
                branches.append((ids.index(case, 1), chain))
                reached.append(local)
        common = [v for v in reached[0] if all(v in r for r in reached[1:])]
        if not common:
            an.fail(
                i,
                eqn,
                "its cases are not elementwise-invertible functions of one common "
                "value",
            )
            return None
        pred_eqns: tuple[int, ...] = ()
        if not an.is_known(ids[0]):
            found = _predicate_from(an, ids[0], common)
            if found is None:
                an.fail(
                    i,
                    eqn,
                    "the predicate of select_n is unknown, and not a function of "
                    "the values its cases are rebuilt from",
                )
                return None
            pred_eqns = found
        step = Select(i, tuple(common), tuple(branches), pred_eqns)
        return step, common, (i,)


def _predicate_from(an, pred, common):
    """The equations, in program order, that compute ``pred`` from ``common``
    and known values; None if it reads anything else."""
    w, need, found, have = an.wiring, [pred], set(), set(common)
    while need:
        v = need.pop()
        if v is None or v in have or an.is_known(v):
            continue
        j = an.eqn_of.get(v)
        if j is None:
            return None
        if j not in found:
            found.add(j)
            need.extend(w.eqn_ins[j])
    return tuple(sorted(found))


def _chain_to(an, case, shape, same=None):
    """Position-wise solves from ``case`` back towards known values.

    Returns one ``(chain, local)`` per leaf: a nested ``select_n`` with a known
    predicate forks the walk, one leaf per case, recorded in the chain as
    ``(eqn, "select_n", case position)``. ``local`` lists the variables the
    chain rebuilds, each exact where every select on the way picks that leaf.
    ``same`` is ``(pred, position)`` of the outer select's predicate (known or
    not) and this case: a nested select on that very predicate (the safe
    ``where`` inside ``jax.nn.elu``) picks the same position, and is followed
    there.
    """
    w, steps, local, v = an.wiring, (), (case,), case
    while (j := an.eqn_of.get(v)) is not None:
        e = an.jaxpr.eqns[j]
        name = jx.primitive_name(e)
        if not all(o in local for o in w.eqn_outs[j]):
            break
        if name == "select_n" and same is not None and _on_same(an, j, same):
            u_id = w.eqn_ins[j][same[1]]
            if u_id is None or an.is_known(u_id) or u_id in local:
                break
            if tuple(an.avals[u_id].shape) != shape:
                break
            steps += ((j, name, same[1]),)
            v = u_id
            local += (v,)
            continue
        if name == "select_n":
            forks = _forks(an, j, local, shape)
            if forks is None:
                break
            leaves = []
            for u in forks:
                u_id = w.eqn_ins[j][u]
                for chain, reached in _chain_to(an, u_id, shape, same):
                    leaves.append(((*steps, (j, name, u), *chain), local + reached))
            return leaves
        u = _position_step(an, j, e, local, shape)
        if u is None:
            break
        steps += ((j, name, u),)
        v = w.eqn_ins[j][u]
        local += (v,)
    return [(steps, local)]


def _on_same(an, j, same) -> bool:
    """Whether select ``j`` reads the outer select's predicate (known, or
    unknown and decided by consistency): it then picks the same position."""
    ids = an.wiring.eqn_ins[j]
    return ids[0] is not None and ids[0] == same[0] and len(ids) > same[1]


def _forks(an, j, local, shape):
    """The case positions of a nested ``select_n`` to follow, or None."""
    ids = an.wiring.eqn_ins[j]
    cases = ids[1:]
    if not an.is_known(ids[0]) or len(set(cases)) != len(cases):
        return None
    for c in cases:
        if an.is_known(c) or c in local or tuple(an.avals[c].shape) != shape:
            return None
    return range(1, len(ids))


def _position_step(an, j, e, local, shape):
    """The one unknown input of equation ``j`` if it solves position-wise."""
    w = an.wiring
    rule = registry.get(jx.primitive_name(e))
    unk = [n for n, u in enumerate(w.eqn_ins[j]) if not an.is_known(u)]
    if rule is None or len(unk) != 1:
        return None
    u = w.eqn_ins[j][unk[0]]
    if u in local or tuple(an.avals[u].shape) != shape:
        return None
    if rule.structural:
        return unk[0] if rule.positionwise(an, j, e, unk[0]) else None
    if not rule.elementwise:
        return None
    mask = [n != unk[0] for n in range(len(e.invars))]
    try:
        abstract_solve(rule, e, mask, lambda n: an.static_value(j, n))
    except NotInvertibleError:
        return None
    return unk[0]


def positionwise_path(jaxpr, known_in, out: int, target: int) -> bool:
    """Whether output ``out`` of ``jaxpr`` is a position-wise invertible
    function of its input ``target``, the inputs ``known_in`` being known.

    Used by the ``positionwise`` hooks of calls and scans on their bodies.
    """
    an = Analysis(jaxpr, known_in, [False] * len(jaxpr.outvars))
    w = an.wiring
    for j, ins in enumerate(w.eqn_ins):  # what is computed from known inputs
        if all(an.is_known(v) for v in ins):
            an.known.update(v for v in w.eqn_outs[j] if v is not None)
    start, goal = w.outvars[out], w.invars[target]
    if start is None or an.is_known(start):
        return False
    shape = tuple(an.avals[start].shape)
    if tuple(an.avals[goal].shape) != shape:
        return False
    return all(goal in local for _, local in _chain_to(an, start, shape))


class _SelectHandler(Handler):
    def needs(self, it, step):
        w = it.wiring
        needs = [*w.eqn_outs[step.eqn]]
        if step.pred_eqns:  # the known inputs of the predicate's equations
            made = {o for j in step.pred_eqns for o in w.eqn_outs[j]}
            for j in step.pred_eqns:
                needs += [
                    v
                    for v in w.eqn_ins[j]
                    if v is not None and v not in made and v not in step.vars
                ]
        else:
            needs.append(w.eqn_ins[step.eqn][0])
        outer = w.eqn_ins[step.eqn][0]
        for _, chain in step.branches:
            for j, name, u in chain:
                if name == "select_n":
                    if not (step.pred_eqns and w.eqn_ins[j][0] == outer):
                        needs.append(w.eqn_ins[j][0])
                else:
                    needs += [v for n, v in enumerate(w.eqn_ins[j]) if n != u]
        return needs

    def run(self, it, step, out_cts):
        w, eqns = it.wiring, it.jaxpr.eqns
        pred = None if step.pred_eqns else it.read_in(step.eqn, 0)
        y = it.read(w.eqn_outs[step.eqn][0])
        ids = w.eqn_ins[step.eqn]
        merged: dict = {}
        # With an unknown predicate: where some branch is consistent, and
        # where two are with different values (the select is not injective).
        anywhere = ambiguous = None
        candidates: dict = {v: [] for v in step.vars}
        for pos, chain in step.branches:
            # where this leaf's values are exact
            where = True if pred is None else pred == pos - 1
            local = {ids[pos]: y}
            solves = []  # checked where this leaf is picked, once that is known
            for j, name, u in chain:
                e = eqns[j]
                if name == "select_n":  # a nested select's case, where picked
                    if pred is not None or w.eqn_ins[j][0] != ids[0]:
                        where = where & (it.read_in(j, 0) == u - 1)
                    # else: the outer predicate itself, checked below
                    local[w.eqn_ins[j][u]] = local[w.eqn_outs[j][0]]
                    continue
                ins = [
                    None if n == u else it.read_in(j, n) for n in range(len(e.invars))
                ]
                outs = [local[o] for o in w.eqn_outs[j]]
                rule = registry.get(name)
                if rule.structural:
                    # Its own records would hold where this leaf is not picked.
                    with runtime_checks.scope():
                        solved = rule.solve_positionwise(it, j, e, u, outs)
                else:
                    avals = [jx.aval(v) for v in e.invars]
                    solved = rule(outs, ins, e.params, avals)[u]
                local[w.eqn_ins[j][u]] = solved
                solves.append((solved, [y, *[x for x in ins if x is not None]], e))
            if pred is None:
                picked = _predicate_at(it, step, local)
                where = where & (picked == pos - 1)
                if anywhere is not None:  # two consistent, different candidates
                    for v in step.vars:
                        same = _agree([local[v], merged[v]])
                        clash = where & anywhere & ~same
                        ambiguous = clash if ambiguous is None else ambiguous | clash
                anywhere = where if anywhere is None else anywhere | where
            for solved, given, e in solves:
                runtime_checks.record(
                    [jnp.where(where, solved, 0)], given, degenerate(e)
                )
            for v in step.vars:
                candidates[v].append(local[v])
                old = merged.get(v)
                merged[v] = local[v] if old is None else jnp.where(where, local[v], old)
        for v in step.vars:
            value = merged[v]
            if anywhere is not None and jnp.issubdtype(value.dtype, jnp.inexact):
                # Where no case is consistent but all candidates agree, the
                # value sits at a continuous switch and rounding (or a flushed
                # subnormal) put each candidate on the other side: keep it.
                at_switch = _agree(candidates[v]) & ~anywhere
                value = jnp.where(at_switch, candidates[v][0], value)
                ok = anywhere | at_switch
                if ambiguous is not None:
                    ok = ok & ~ambiguous
                value = jnp.where(ok, value, jnp.nan)
                runtime_checks.record([value], [y], _not_one_case(eqns[step.eqn]))
            it.set([v], [value])
        return None


def _agree(values):
    """Where every candidate equals the first to a few units of rounding (exact
    equality for integers)."""
    first = values[0]
    if not jnp.issubdtype(first.dtype, jnp.inexact):
        out = jnp.ones(jnp.shape(first), bool)
        for other in values[1:]:
            out = out & (other == first)
        return out
    eps = 16 * jnp.finfo(first.dtype).eps
    tiny = jnp.finfo(first.dtype).tiny
    out = jnp.isfinite(first)
    for other in values[1:]:
        scale = jnp.abs(first) + jnp.abs(other)
        out = out & (jnp.abs(other - first) <= eps * scale + 4 * tiny)
    return out


def _not_one_case(eqn) -> str:
    where = jx.where(eqn)
    return (
        f"`select_n`{f' at {where}' if where else ''}: no input, or more than "
        "one, maps to an output (NaN there), so its predicate cannot be decided "
        "from the rebuilt value: the select is not injective (as "
        "where(x > 0, x, -x)), or the output is outside its range"
    )


def _predicate_at(it, step, local):
    """The predicate of ``step``'s select, evaluated on one branch's candidate
    values ``local`` (the known inputs of its equations as they are)."""
    env = {v: local[v] for v in step.vars}
    env = run_cone(it.jaxpr, it.wiring, step.pred_eqns, env, it.read_in)
    return env[it.wiring.eqn_ins[step.eqn][0]]


class _SelectTerms(log_det.TermRule):
    """Each position adds the terms of the case chain its predicates pick."""

    def has_terms(self, step, eqn):
        for _, chain in step.branches:
            for _, name, _ in chain:
                rule = registry.get(name)
                if name != "select_n" and (
                    rule.structural or not rule.volume_preserving
                ):
                    return True
        return False

    def term(self, ev, step):
        eqns = ev.jaxpr.eqns
        pred = ev.read_in(step.eqn, 0)
        total = None
        for pos, chain in _to_common(ev, step):
            where = pred == pos - 1
            leaf = None
            for j, name, u in chain:
                e = eqns[j]
                if name == "select_n":
                    where = where & (ev.read_in(j, 0) == u - 1)
                    continue
                rule = registry.get(name)
                if rule.structural:
                    raise log_det.refusal(
                        e, "a nested call or scan on a case of select_n"
                    )
                if rule.volume_preserving:
                    continue
                t = ev.rule_term(name, j, u)
                leaf = t if leaf is None else leaf + t
            if leaf is not None:
                picked = jnp.where(where, leaf, jnp.zeros((), leaf.dtype))
                total = picked if total is None else total + picked
        if total is None:
            return None
        eqn = eqns[step.eqn]
        return ev.reduce(total, jx.aval(eqn.outvars[0]), eqn)


def _to_common(ev, step) -> list:
    """The branches cut after the last value the step rebuilds: a chain
    forking further (a nested select towards values the step does not
    rebuild) adds no terms beyond it, and the branches that are then the
    same are counted once."""
    common, out = set(step.vars), []
    for pos, chain in step.branches:
        last = 0
        for n, (j, _, u) in enumerate(chain):
            if ev.wiring.eqn_ins[j][u] in common:
                last = n + 1
        branch = (pos, tuple(chain[:last]))
        if branch not in out:
            out.append(branch)
    return out


registry.register_structural(["select_n"], SelectRule())
register_handler(Select, _SelectHandler())
log_det.register_term_rule(Select, _SelectTerms())
