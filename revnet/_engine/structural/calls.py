"""Structural rules for nested calls and ``custom_ivjp`` functions.

* A nested call (``jit``, ``custom_jvp_call``, ``custom_vjp_call``, ``remat``)
  is solved by the plan of its body. For a function with a user derivative
  rule (``custom_jvp``/``custom_vjp``, e.g. ``jax.nn.relu``) the body only
  rebuilds the inputs, and the cotangents come from the user's rule at the
  rebuilt inputs, so the rule is honoured. A call whose body maps an input to
  its one output position by position may lie on a ``select_n`` case's chain.
* A ``custom_ivjp`` function is a ``custom_vjp_call`` whose backward is tagged
  with the function; it is solved by the user's inverse. The engine sees it
  through this protocol only: ``num_consts``, ``trees`` (flat input shapes ->
  ``(in_tree, out_tree)``), ``invert(consts, outputs)``, ``ivjp(consts,
  outputs, cts)``, ``log_det(args)`` (the user's log-determinant, or None),
  ``user_vjp`` (a fused ``defivjp`` rule) and ``remade`` (constants it makes
  again when they are unknown: :mod:`revnet._engine.decisions.ivjp_replay`). Its call
  is matched to its record by its last inputs: JAX hoists what it closes over
  as leading ones, which a traced-again jaxpr no longer marks.
* revnet's ``while_loop`` is refused inside another function: its trip count
  is not one of its outputs. revnet's ``scan`` is solved through its body.
* JAX's hijax calls (``call_hi_primitive``, under JAX_CUSTOM_VJP3 and
  JAX_REMAT3) are nested calls too: their body is the primitive's expansion
  (:func:`revnet._engine.jaxpr.call_body`), and a ``custom_vjp``'s rule, or a
  ``custom_ivjp``'s tag, is read from the primitive as for ``custom_vjp_call``.
"""

from __future__ import annotations

import contextlib

import jax

from revnet._engine import (
    analysis,
    exact,
    known_bodies,
    log_det,
    registry,
    runtime_checks,
)
from revnet._engine import cotangents as ct
from revnet._engine import jaxpr as jx
from revnet._engine.errors import NotInvertibleError, Stuck, degenerate
from revnet._engine.interpreter import (
    Handler,
    apply_eqn,
    register_handler,
    run_plan,
    vjp_eqn,
)
from revnet._engine.plan import Call, Custom
from revnet._engine.structural import select


class CallRule(registry.StructuralRule):
    """Solves nested calls by their body's plan, ``custom_ivjp`` by its inverse."""

    name = "call"

    def analyze(self, an, i, eqn, ins, outs):
        if not any(outs) or not an.distinct_unknowns(i, eqn, ins):
            return None
        tag, kind = jx.tag_of(eqn), jx.tag_kind(eqn)
        if kind == "while_loop":
            an.fail(
                i,
                eqn,
                "revnet.while_loop cannot be run backwards here: its trip count is "
                "not one of its outputs; call it outside @invertible (it already "
                "rebuilds its carry), or use revnet.scan with a fixed length",
            )
            return None
        custom_ivjp = kind == "custom_ivjp"
        body = _body(eqn)
        if body is None and not custom_ivjp:
            an.fail(i, eqn, _no_body(eqn))
            return None
        if not all(outs) and (custom_ivjp or body is None):
            an.fail_for_outputs(i, eqn)
            return None
        if custom_ivjp:
            return self._custom(an, i, eqn, tag, ins)
        unknown = tuple(n for n, k in enumerate(ins) if not k)
        known_in = (True,) * len(body.consts) + tuple(ins)
        try:
            plan = analysis.analyze(body.jaxpr, known_in, tuple(outs))
        except Stuck as stuck:
            found = known_bodies.recognise(an, i, eqn, ins)
            if found is not None:
                return found
            an.fail(
                i,
                eqn,
                "its body is not invertible",
                stuck.failure,
                waits_for=lambda: _waits_for(an, i, body, known_in, outs),
            )
            return None
        custom = jx.custom_rule_kind(eqn) is not None and tag is None
        step = Call(i, unknown, plan, custom)
        return step, [an.wiring.eqn_ins[i][n] for n in unknown], (i,)

    def positionwise(self, an, i, eqn, unknown):
        kind = jx.tag_kind(eqn)
        body = _body(eqn)
        if body is None or len(eqn.outvars) != 1:
            return False
        if kind is not None and kind != "scan":
            return False  # a user inverse, or a while_loop: not looked into
        nb = len(body.consts)
        known_in = _known_body_inputs(body, eqn, unknown)
        if not select.positionwise_path(body.jaxpr, known_in, 0, nb + unknown):
            return False
        try:
            analysis.analyze(body.jaxpr, known_in, (True,))
        except Stuck:
            return False
        return True

    def solve_positionwise(self, it, i, eqn, unknown, outs):
        body = _body(eqn)
        known_in = _known_body_inputs(body, eqn, unknown)
        plan = analysis.analyze(body.jaxpr, known_in, (True,))
        given = [it.read_in(i, n) for n in range(len(eqn.invars)) if n != unknown]
        vals, _ = run_plan(plan, body.jaxpr, [*body.consts, *given], list(outs))
        return vals[0]

    def _custom(self, an, i, eqn, fn, ins):
        name = fn.__name__
        match = jx.custom_ivjp_match(eqn, fn.trees)
        if match is None:
            an.fail(
                i,
                eqn,
                f"custom_ivjp function {name!r} was not called with these shapes",
            )
            return None
        # JAX hoists the values the function closes over as the ``nh``
        # leading inputs: known ones are constants of the inversion.
        nh, (in_tree, out_tree) = match
        n_const = sum(c.num_leaves for c in in_tree.children()[: fn.num_consts])
        if not all(ins[:nh]):
            an.fail(
                i,
                eqn,
                f"custom_ivjp function {name!r} closes over a value computed from "
                "the inputs being rebuilt; pass it as an argument instead",
            )
            return None
        # Values the function makes again itself when they are not known (a
        # replaying call's decisions: revnet._engine.decisions.ivjp_replay).
        remade = tuple(nh + n for n in fn.remade if not ins[nh + n])
        if not all(
            k or n in remade for n, k in enumerate(ins) if nh <= n < nh + n_const
        ):
            an.fail(
                i, eqn, f"the constants of custom_ivjp function {name!r} are unknown"
            )
            return None
        unknown = tuple(range(nh + n_const, len(ins)))
        step = Custom(i, unknown, nh, n_const, in_tree, out_tree, remade)
        return step, [an.wiring.eqn_ins[i][n] for n in unknown], (i,)


def _waits_for(an, i, body, known_in, outs) -> list:
    """The unknown outputs of call ``i`` when its body would be invertible
    with them known (its failure is then theirs), else none."""
    if all(outs):
        return []
    try:
        analysis.analyze(body.jaxpr, known_in, (True,) * len(outs))
    except Stuck:
        return []
    return [v for v in an.wiring.eqn_outs[i] if not an.is_known(v)]


def _body(eqn):
    """The body a call is solved by (exact mode's grid: the identity)."""
    return exact.solving_body(eqn, jx.call_body(eqn))


def _no_body(eqn) -> str:
    """Why a call without a body (a hijax primitive revnet cannot expand) fails."""
    kind = jx.hi_kind(eqn)
    if kind == "Scan3":
        return jx.scan3_refusal(eqn)
    return f"`{jx.primitive_name(eqn)}` ({kind or 'no body'}) has no inverse rule"


def _known_body_inputs(body, eqn, unknown: int) -> tuple[bool, ...]:
    """A call body's known inputs when only the call's input ``unknown`` is not."""
    n = len(eqn.invars)
    return (True,) * len(body.consts) + tuple(k != unknown for k in range(n))


def _split(it, step, unread=()):
    """``(equation, its input values with None for the unknown ones and for
    those in ``unread``)``."""
    i = step.eqn
    eqn = it.jaxpr.eqns[i]
    unknown = {*step.unknown, *unread}
    known = [None if n in unknown else it.read_in(i, n) for n in range(len(eqn.invars))]
    return eqn, known


class _CallHandler(Handler):
    fuses = True

    def known_outs(self, it, step):
        return list(step.plan.known_out)

    def run(self, it, step, out_cts):
        eqn, known = _split(it, step)
        body = _body(eqn)
        consts = list(body.consts)
        outs = [
            it.read(v)
            for v, k in zip(it.wiring.eqn_outs[step.eqn], step.plan.known_out)
            if k
        ]
        given = [x for x in known if x is not None]
        perturbed = it.perturbed(step.eqn)
        ins, cts = run_plan(
            step.plan,
            body.jaxpr,
            consts + given,
            outs,
            None if step.custom else out_cts,
            None if perturbed is None else [False] * len(consts) + perturbed,
        )
        if exact.add_params(eqn) is not None:
            ins = exact.guard(eqn, outs, list(ins), given)
        if cts is not None:
            cts = cts[len(consts) :]
        elif step.custom and out_cts is not None:
            # The user's derivative rule, at the rebuilt inputs.
            rebuilt = iter(ins)
            full = [next(rebuilt) if x is None else x for x in known]
            _, vjp = vjp_eqn(eqn, full, perturbed)
            cts = vjp(out_cts) if vjp is not None else [None] * len(full)
        it.set([it.wiring.eqn_ins[step.eqn][n] for n in step.unknown], ins)
        return cts


class _CustomHandler(Handler):
    fuses = True

    def needs(self, it, step):
        remade = {it.wiring.eqn_ins[step.eqn][n] for n in step.remade}
        return [v for v in super().needs(it, step) if v is None or v not in remade]

    def run(self, it, step, out_cts):
        eqn, known = _split(it, step, step.remade)
        fn = jx.tag_of(eqn)
        outs = [it.read(v) for v in it.wiring.eqn_outs[step.eqn] if v is not None]
        nk = step.n_hoisted + step.n_const_leaves
        const_tree = jax.tree_util.tree_structure(
            tuple(
                jax.tree_util.tree_unflatten(c, [0] * c.num_leaves)
                for c in step.in_tree.children()[: fn.num_consts]
            )
        )
        consts = tuple(
            jax.tree_util.tree_unflatten(const_tree, known[step.n_hoisted : nk])
        )
        outputs = jax.tree_util.tree_unflatten(step.out_tree, outs)
        cts = None
        with _closure_errors(fn, step.n_hoisted):
            if out_cts is None:
                ins = jax.tree_util.tree_leaves(fn.invert(consts, outputs))
            else:
                tree_cts = jax.tree_util.tree_unflatten(step.out_tree, list(out_cts))
                inputs, in_cts = fn.ivjp(consts, outputs, tree_cts)
        if out_cts is not None:
            in_cts = ct.float0_for_ints((*consts, *inputs), in_cts)
            flat = jax.tree_util.tree_leaves(in_cts, is_leaf=lambda x: x is None)
            ins = jax.tree_util.tree_leaves(inputs)
            cts = [None] * step.n_hoisted + flat
            for n in step.remade:
                cts[n] = None
        runtime_checks.record(
            ins, [*outs, *[k for k in known if k is not None]], degenerate(eqn)
        )
        it.set([it.wiring.eqn_ins[step.eqn][n] for n in step.unknown], ins)
        return cts


@contextlib.contextmanager
def _closure_errors(fn, n_hoisted: int):
    """Names what happened when a user's rule uses a value that was traced.

    A ``custom_ivjp`` function may close over values (JAX hoists them as the
    leading inputs of its ``custom_vjp_call``): concrete arrays are constants
    of the inversion, but a value computed inside the traced function is a
    tracer of that trace, which the user's rule cannot use once it is over.
    """
    try:
        yield
    except jax.errors.UnexpectedTracerError:
        if not n_hoisted:
            raise
        raise NotInvertibleError(
            f"custom_ivjp function {fn.__name__!r} closes over a traced value "
            "(computed inside the function being inverted, or being "
            "differentiated) that its inverse rule uses after that trace has "
            "ended; pass the value as a leading argument with num_consts instead"
        ) from None


class _CallTerms(log_det.TermRule):
    """A nested call adds its body's terms; a function with its own derivative
    rule (``custom_jvp``/``custom_vjp``) still gives its outputs (and their
    derivatives) by that rule."""

    evaluates = True

    def has_terms(self, step, eqn):
        return log_det.has_terms(step.plan, _body(eqn).jaxpr)

    def evaluate(self, ev, step, eqn, ins):
        body = _body(eqn)
        outs, term = ev.nested(step.plan, body.jaxpr, [*body.consts, *ins])
        return (apply_eqn(eqn, ins) if step.custom else outs), term


class _CustomTerms(log_det.TermRule):
    """A ``custom_ivjp`` function's log-determinant is the user's own
    (``deflogdet``): a scalar, or one value per example, or values on axes
    that lead with the batch's, summed over the others."""

    def term(self, ev, step):
        eqn = ev.jaxpr.eqns[step.eqn]
        fn = jx.tag_of(eqn)
        ins = [ev.read_in(step.eqn, n) for n in range(len(eqn.invars))]
        args = jax.tree_util.tree_unflatten(step.in_tree, ins[step.n_hoisted :])
        with _closure_errors(fn, step.n_hoisted):
            t = fn.log_det(tuple(args))
        if t is None:
            raise log_det.refusal(
                eqn,
                f"custom_ivjp function {fn.__name__!r} has no log-determinant; "
                "give it one with deflogdet",
            )
        t = jax.numpy.asarray(t).astype(ev.zero.dtype)
        k = ev.zero.ndim
        if t.shape[:k] == ev.zero.shape:
            # One value per example, or per element of axes that lead with
            # the batch's (a term per position of an image): summed.
            t = jax.numpy.sum(t, axis=tuple(range(k, t.ndim)))
            avals = [jx.aval(eqn.invars[n]) for n in step.unknown]
            return ev.shared(ev.like_zero(t), avals, eqn)
        raise log_det.refusal(
            eqn,
            f"the log-determinant of custom_ivjp function {fn.__name__!r} has shape "
            f"{t.shape}; with batch_ndim it is one per example, of shape "
            f"{ev.zero.shape} (or leads with that shape, summed over the rest)",
        )


registry.register_structural(jx.call_primitive_names(), CallRule())
register_handler(Call, _CallHandler())
register_handler(Custom, _CustomHandler())
log_det.register_term_rule(Call, _CallTerms())
log_det.register_term_rule(Custom, _CustomTerms())
