"""The structural rule for ``lax.scan``.

A ``scan`` whose final carry is known and whose body is invertible in its carry
(given the constants and its known ``xs``) is solved by the invert mode of
revnet's loops, :func:`revnet._engine.loops.invert.reversed_scan`: ONE reverse
``lax.scan`` that rebuilds each carry from the next by the body's
plan and, given cotangents, accumulates them step by step, so memory does not
grow with the number of steps. A carry that is computed forward from known
values only (``fori_loop``'s counter) is first run forward by a reduced scan
(a :class:`~revnet._engine.plan.ScanAux` step).
"""

from __future__ import annotations

from revnet._engine import analysis, log_det, registry
from revnet._engine import jaxpr as jx
from revnet._engine.errors import Stuck
from revnet._engine.interpreter import Handler, register_handler
from revnet._engine.loops.invert import reversed_scan
from revnet._engine.plan import Scan, ScanAux
from revnet._engine.structural import select


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
    _, in_idx = jx.restrict(sp.body.jaxpr, carry)
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
        sub, _ = jx.restrict(sp.body.jaxpr, step.carry)
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


class _ScanTerms(log_det.TermRule):
    """A scan adds its steps' terms, summed in one more carry."""

    evaluates = True

    def has_terms(self, step, eqn):
        return log_det.has_terms(step.plan, jx.scan_params(eqn).body.jaxpr)

    def evaluate(self, ev, step, eqn, ins):
        sp = jx.scan_params(eqn)
        nc, ncar = sp.num_consts, sp.num_carry
        consts, init, xs = ins[:nc], ins[nc : nc + ncar], ins[nc + ncar :]

        def body(carry, x):
            c, total = carry
            args = [*sp.body.consts, *consts, *c, *x]
            outs, term = ev.nested(step.plan, sp.body.jaxpr, args)
            return (outs[:ncar], total + term), outs[ncar:]

        (final, total), ys = jx.scan(
            body,
            (list(init), ev.zero),
            list(xs),
            length=sp.length,
            reverse=sp.reverse,
            unroll=sp.unroll,
        )
        return [*final, *ys], total


registry.register_structural(["scan"], ScanRule())
register_handler(ScanAux, _AuxHandler())
register_handler(Scan, _ScanHandler())
log_det.register_term_rule(Scan, _ScanTerms())
