"""plan -> values and cotangents: runs a plan on the jaxpr it is given.

:class:`Interpreter` rebuilds variables on demand by running the steps that
produce them, and :meth:`Interpreter.backward` walks the equations in reverse
applying each one's VJP. Values evaluated forward come from ``jax.vjp``, so
the evaluation of ``F(x2)`` that rebuilds ``x1 = y1 - F(x2)`` is the one whose
VJP is taken (RevNet's 4/3 cost). Steps that rebuild an equation's inputs and
can give their cotangents in the same pass (nested calls, ``custom_ivjp``,
scans) are *fused*: run once, with the output cotangents.

Each step type has a :class:`Handler` in one table (:func:`register_handler`);
the structural rules' modules register theirs. The equations, their params
and rule objects come from the jaxpr passed in, never from the plan, so one
plan serves every trace of the same structure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax

from revnet._engine import cotangents as ct
from revnet._engine import jaxpr as jx
from revnet._engine import perturbed as pb
from revnet._engine import registry, runtime_checks
from revnet._engine.errors import degenerate
from revnet._engine.plan import Forward, Plan, Solve


class Handler:
    """How the interpreter runs one step type.

    Attributes:
      fuses: whether ``run`` given output cotangents also returns the input
        cotangents of the step's equation.
    """

    fuses = False

    def needs(self, it: Interpreter, step: Any) -> list[int | None]:
        """The variable ids the step reads (None entries are literals)."""
        eqn = step.eqn
        unknown = set(step.unknown)
        ins = [v for n, v in enumerate(it.wiring.eqn_ins[eqn]) if n not in unknown]
        outs = it.wiring.eqn_outs[eqn]
        return ins + [v for v, k in zip(outs, self.known_outs(it, step)) if k]

    def known_outs(self, it: Interpreter, step: Any) -> list[bool]:
        """Which of the step's equation's outputs it reads."""
        return [v is not None for v in it.wiring.eqn_outs[step.eqn]]

    def run(self, it: Interpreter, step: Any, out_cts: list | None) -> list | None:
        raise NotImplementedError


_HANDLERS: dict[type, Handler] = {}


def register_handler(step_type: type, handler: Handler) -> None:
    """Makes ``handler`` run the plan steps of type ``step_type``."""
    _HANDLERS[step_type] = handler


def step_needs(it: Any, step: Any) -> list[int | None]:
    """The variable ids ``step`` reads; ``it`` needs only ``wiring``/``jaxpr``."""
    return _HANDLERS[type(step)].needs(it, step)


def apply_eqn(eqn: Any, ins: Sequence[Any]) -> list[Any]:
    """Evaluates ``eqn`` on ``ins``, through its primitive's evaluator if any."""
    fn = registry.evaluator(jx.primitive_name(eqn))
    if fn is None:
        return jx.bind(eqn, *ins)
    with jx.context(eqn):
        return fn(jx.bind_params(eqn), list(ins))


def run_cone(
    jaxpr: Any,
    wiring: Any,
    cone: Iterable[int],
    env: dict,
    outside: Callable[[int, int], Any],
) -> dict:
    """Evaluates the equations ``cone`` of ``jaxpr`` in order, by
    :func:`apply_eqn`, into ``env`` (the wiring's ids to values).

    Args:
      jaxpr: the program whose equations are indexed by ``cone``.
      wiring: its ids (``eqn_ins``, ``eqn_outs``).
      cone: the equations to evaluate, in order.
      env: the values set so far (the cone's own inputs); updated.
      outside: ``(i, n) -> value`` of input ``n`` of equation ``i`` when it is
        not in ``env`` (literals included).

    Returns:
      ``env``, with the cone's outputs.
    """
    for i in cone:
        ins = [
            env[v] if v is not None and v in env else outside(i, n)
            for n, v in enumerate(wiring.eqn_ins[i])
        ]
        for v, o in zip(wiring.eqn_outs[i], apply_eqn(jaxpr.eqns[i], ins)):
            if v is not None:
                env[v] = o
    return env


def evaluate(jaxpr: Any, args: Sequence[Any]) -> list[Any]:
    """Evaluates an open ``jaxpr`` on ``args``, every equation by :func:`apply_eqn`.

    As ``jax.core.eval_jaxpr``, except that primitives with an evaluator in the
    registry (convolutions on CPU) run through it, as in the interpreter.
    """
    env = dict(zip(jaxpr.invars, args))
    return evaluate_eqns(jaxpr.eqns, env, jaxpr.outvars)


def evaluate_eqns(eqns: Sequence[Any], env: dict, outs: Sequence[Any]) -> list[Any]:
    """Evaluates ``eqns`` in order from ``env`` (their free variables to
    values), and returns the values of the atoms ``outs``."""

    def read(v):
        return jx.literal_value(v) if jx.is_literal(v) else env[v]

    for e in eqns:
        for v, o in zip(e.outvars, apply_eqn(e, [read(v) for v in e.invars])):
            if not jx.is_dropvar(v):
                env[v] = o
    return [read(v) for v in outs]


def vjp_eqn(eqn: Any, ins: Sequence[Any], perturbed: Sequence[bool] | None = None):
    """Evaluates ``eqn`` with ``jax.vjp`` over its float (perturbed) inputs.

    Returns ``(outs, vjp)`` where ``vjp(out_cts)`` gives one cotangent (or None)
    per input; ``vjp`` is None when no cotangent can flow (no float input or
    output, or a derivative that is identically zero, such as ``stop_gradient``
    in ``jax.nn.softmax``: plain autodiff sends no cotangent there either).
    With ``perturbed``, only those inputs are differentiated: the others have
    symbolic zero tangents, as in JAX (:mod:`.perturbed`).
    """
    float_in = [
        n
        for n, v in enumerate(eqn.invars)
        if not jx.is_literal(v)
        and ct.is_float_aval(jx.aval(v))
        and (perturbed is None or perturbed[n])
    ]
    if (
        not float_in
        or not any(ct.is_float_aval(jx.aval(v)) for v in eqn.outvars)
        or jx.has_zero_derivative(eqn)
    ):
        return apply_eqn(eqn, ins), None

    def f(*fl):
        args = list(ins)
        for n, x in zip(float_in, fl):
            args[n] = x
        return apply_eqn(eqn, args)

    outs, pullback = jax.vjp(f, *[ins[n] for n in float_in])

    def vjp(cts):
        res = [None] * len(ins)
        for n, c in zip(float_in, pullback(list(cts))):
            res[n] = c
        return res

    return outs, vjp


class Interpreter:
    """Runs a :class:`Plan` on ``jaxpr``; one instance per (nested) evaluation."""

    def __init__(
        self,
        plan: Plan,
        jaxpr: Any,
        known_in_vals,
        out_vals,
        perturbed=None,
        *,
        stored: int = 0,
    ):
        """``perturbed``: which inputs are differentiated (None: every float).

        ``stored``: how many of ``jaxpr``'s last outputs are stored decisions
        (:func:`revnet._engine.decisions.expose`). Their derivative is zero by
        design, so no cotangent is sent to them: the equations that made them
        (the deciding calls) are not differentiated.
        """
        self.plan, self.jaxpr, self.wiring = plan, jaxpr, plan.wiring
        outvars = self.wiring.outvars
        self.stored = set(outvars[len(outvars) - stored :]) if stored else set()
        self.stored.discard(None)
        self.active = None  # variable ids a perturbation reaches; None: all
        if perturbed is not None:
            reached = pb.active_vars(jaxpr, perturbed)
            ids = _ids(jaxpr)
            self.active = {ids[v] for v in reached}
        self.env: dict = {}
        it = iter(known_in_vals)
        for v, k in zip(self.wiring.invars, plan.known_in):
            if k:
                self.env[v] = next(it)
        it = iter(out_vals)
        for v, k in zip(self.wiring.outvars, plan.known_out):
            if k:
                val = next(it)
                if v is not None:
                    self.env[v] = val
        self.vjps: dict = {}  # eqn index -> vjp function from a forward step
        self.done: set = set()  # indices of steps already run

    def perturbed(self, i: int) -> list[bool] | None:
        """Which inputs of equation ``i`` are perturbed (None: all)."""
        if self.active is None:
            return None
        return [v is not None and v in self.active for v in self.wiring.eqn_ins[i]]

    # -- values ---------------------------------------------------------------- #

    def read(self, v: int) -> Any:
        if v not in self.env:
            self.demand([v])
        return self.env[v]

    def read_ins(self, i: int, unknown: set[int]) -> list[Any]:
        """The inputs of equation ``i``, with None at the ``unknown`` positions."""
        n_in = len(self.jaxpr.eqns[i].invars)
        return [None if n in unknown else self.read_in(i, n) for n in range(n_in)]

    def read_in(self, i: int, n: int) -> Any:
        """The value of input ``n`` of equation ``i`` (a literal's, or rebuilt)."""
        v = self.wiring.eqn_ins[i][n]
        if v is None:
            return jx.literal_value(self.jaxpr.eqns[i].invars[n])
        return self.read(v)

    def set(self, ids: Sequence[int | None], vals: Sequence[Any]) -> None:
        for v, val in zip(ids, vals):
            if v is not None:
                self.env.setdefault(v, val)

    def demand(self, ids: Sequence[int | None]) -> None:
        """Runs the steps that produce ``ids``, and their prerequisites."""
        producer, steps = self.plan.producer, self.plan.steps
        stack = [producer[v] for v in ids if v is not None and v not in self.env]
        expanded: set = set()  # steps whose prerequisites were pushed
        while stack:
            s = stack[-1]
            if s in self.done:
                stack.pop()
                continue
            missing = [
                producer[v]
                for v in self.needs(steps[s])
                if v is not None and v not in self.env
            ]
            missing = [m for m in missing if m not in self.done]
            if missing:
                if s in expanded or any(m in expanded for m in missing):
                    # A cycle, or prerequisites that ran without producing
                    # what they promised: pushing again would never end.
                    raise RuntimeError(
                        f"revnet internal error: step {s} of the inversion plan "
                        f"({type(steps[s]).__name__}) needs values that depend "
                        "on itself; please report it with the function"
                    )
                expanded.add(s)
                stack.extend(missing)
                continue
            stack.pop()
            self.run(steps[s], None)
            self.done.add(s)

    def needs(self, step: Any) -> list[int | None]:
        return step_needs(self, step)

    def run(self, step: Any, out_cts: list | None) -> list | None:
        """Runs one step; fused steps given ``out_cts`` also return input cts."""
        return _HANDLERS[type(step)].run(self, step, out_cts)

    def values(self) -> list:
        """The rebuilt values of the unknown inputs."""
        w, known = self.wiring, self.plan.known_in
        return [self.read(v) for v, k in zip(w.invars, known) if not k]

    # -- cotangents ------------------------------------------------------------ #

    def backward(self, out_cts: Sequence[Any], need_values: bool):
        """Applies every equation's VJP in reverse; returns input cotangents."""
        w, eqns, steps = self.wiring, self.jaxpr.eqns, self.plan.steps
        cts: dict = {}
        for v, c in zip(w.outvars, out_cts):
            if v is not None and c is not None:
                cts[v] = ct.add(cts.get(v), c)
        fused = {
            step.eqn: s for s, step in enumerate(steps) if _HANDLERS[type(step)].fuses
        }
        for i in range(len(eqns) - 1, -1, -1):
            eqn = eqns[i]
            outs = w.eqn_outs[i]
            got = [cts.pop(v, None) if v is not None else None for v in outs]
            if all(c is None for c in got):
                continue
            got = [
                c if c is not None else ct.zeros(jx.aval(o))
                for o, c in zip(eqn.outvars, got)
            ]
            s = fused.get(i)
            in_cts = None
            if s is not None and s not in self.done:
                # Rebuild this equation's inputs and their cotangents in one go.
                self.demand(self.needs(steps[s]))
                in_cts = self.run(steps[s], got)
                self.done.add(s)
            elif i in self.vjps:
                in_cts = self.vjps.pop(i)(got)
            if in_cts is None:
                if s is not None:  # values were needed earlier: rerun, fused
                    in_cts = self.run(steps[s], got)
                else:
                    ins = [self.read_in(i, n) for n in range(len(eqn.invars))]
                    _, vjp = vjp_eqn(eqn, ins, self.perturbed(i))
                    in_cts = vjp(got) if vjp is not None else [None] * len(ins)
            for v, a, c in zip(w.eqn_ins[i], eqn.invars, in_cts):
                if v is None or c is None or ct.is_float0(c) or v in self.stored:
                    continue
                if ct.is_float_aval(jx.aval(a)):
                    cts[v] = ct.add(cts.get(v), c)
        in_cts = [cts.get(v) for v in w.invars]
        return (self.values() if need_values else None), in_cts


def _ids(jaxpr: Any) -> dict:
    """Each variable of ``jaxpr`` to its id in the plan's wiring."""
    ids: dict = {}
    for v in jaxpr.invars:
        ids[v] = len(ids)
    for e in jaxpr.eqns:
        for v in e.outvars:
            if not jx.is_dropvar(v):
                ids[v] = len(ids)
    return ids


def run_plan(
    plan: Plan, jaxpr: Any, known_in_vals, out_vals, out_cts=None, perturbed=None
):
    """Rebuilds a plan's unknown inputs; with ``out_cts`` also all input cts.

    ``perturbed``: which inputs are differentiated (None: every float one).

    Returns:
      ``(values of the unknown inputs, input cotangents or None)``.
    """
    interp = Interpreter(plan, jaxpr, known_in_vals, out_vals, perturbed)
    if out_cts is None:
        return interp.values(), None
    return interp.backward(out_cts, need_values=True)


class _ForwardHandler(Handler):
    def needs(self, it, step):
        return list(it.wiring.eqn_ins[step.eqn])

    def run(self, it, step, out_cts):
        i = step.eqn
        eqn = it.jaxpr.eqns[i]
        ins = [it.read_in(i, n) for n in range(len(eqn.invars))]
        outs, vjp = vjp_eqn(eqn, ins, it.perturbed(i))
        it.set(it.wiring.eqn_outs[i], outs)
        if vjp is not None:
            it.vjps[i] = vjp
        return None


class _SolveHandler(Handler):
    def run(self, it, step, out_cts):
        i = step.eqn
        eqn = it.jaxpr.eqns[i]
        unknown = set(step.unknown)
        known = it.read_ins(i, unknown)
        outs = [None if v is None else it.read(v) for v in it.wiring.eqn_outs[i]]
        avals = [jx.aval(v) for v in eqn.invars]
        with jx.context(eqn):
            solved = registry.get(step.rule)(outs, known, eqn.params, avals)
        new = [solved[n] for n in step.unknown]
        runtime_checks.record(
            new, [*outs, *[k for k in known if k is not None]], degenerate(eqn)
        )
        it.set([it.wiring.eqn_ins[i][n] for n in step.unknown], new)
        return None


register_handler(Forward, _ForwardHandler())
register_handler(Solve, _SolveHandler())
