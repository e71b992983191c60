"""Log-determinants derived from the inversion plan.

The plan rebuilds a program's unknown inputs from its outputs, each unknown
solved from one equation whose other inputs are known. Ordered that way, the
program's Jacobian is block triangular, so

    log|det J| = sum over the plan's solves of log|det d(outputs)/d(solved)|,

each term local to one equation. The terms come from the rules
(:class:`~revnet._engine.registry.InverseRule`'s ``log_det``: ``log|f'(x)|``
for a bijection, ``log|k|`` for a known factor, ``slogdet`` of a known matrix
per row, zero for sums of known values and layout ops) and from the steps of
the structural rules, which register a :class:`TermRule` here: a nested call
sums its body's terms, a ``scan`` the terms of its steps, a ``select_n`` the
picked case's, a ``custom_ivjp`` function its own (``deflogdet``), and a
``shard_map`` its devices' terms with each distinct block counted once: a term
is summed (``psum``) over the manual mesh axes along which the value it
solves varies, so a value replicated along an axis counts once
(:mod:`revnet._engine.structural.shard_map`). A step type without one is
refused.

:func:`evaluate` runs a program forward and adds up the terms of the steps the
inverse would take, from the forward values: the result is plain JAX, so it
differentiates, batches and runs backwards (inside ``@revnet.invertible``)
like the rest of the program. Only the steps that rebuild the unknown inputs
count; equations evaluated forward add nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from revnet._engine import jaxpr as jx
from revnet._engine import registry, sharded_types
from revnet._engine.batching.axes import LEADING, UNBATCHED, Tracker
from revnet._engine.errors import NotInvertibleError
from revnet._engine.interpreter import apply_eqn, run_cone, step_needs
from revnet._engine.plan import Forward, Plan, ScanAux, Solve, Tile


class LogDetError(NotInvertibleError):
    """A program revnet inverts whose log-determinant it cannot derive."""


def refusal(eqn: Any, reason: str) -> LogDetError:
    """The one-line refusal for equation ``eqn``, naming its source line."""
    where = jx.where(eqn)
    at = f" at {where}" if where else ""
    return LogDetError(
        f"no log-determinant for `{jx.primitive_name(eqn)}`{at}: {reason}"
    )


class TermRule:
    """How one plan step type adds to the log-determinant.

    Attributes:
      evaluates: whether :meth:`evaluate` runs the step's equation (a nested
        call, a scan: the terms are computed inside it); otherwise
        :meth:`term` reads the forward values.
    """

    evaluates = False

    def has_terms(self, step: Any, eqn: Any) -> bool:
        """Whether the step may add a non-zero term (False: skip it)."""
        return True

    def evaluate(self, ev: Evaluation, step: Any, eqn: Any, ins: list) -> tuple:
        """``(outputs, term or None)`` of the step's equation on ``ins``."""
        raise NotImplementedError

    def term(self, ev: Evaluation, step: Any) -> Any:
        """The step's reduced term (see :meth:`Evaluation.reduce`), or None."""
        raise NotImplementedError


_RULES: dict[type, TermRule] = {}


def register_term_rule(step_type: type, rule: TermRule) -> None:
    """Makes ``rule`` give the log-determinant terms of ``step_type`` steps."""
    _RULES[step_type] = rule


class _Zero(TermRule):
    def has_terms(self, step, eqn):
        return False

    def term(self, ev, step):
        return None


class _Solve(TermRule):
    """A primitive's inverse rule: its ``log_det`` for each solved input."""

    def has_terms(self, step, eqn):
        return not registry.get(step.rule).volume_preserving

    def term(self, ev, step):
        eqn = ev.jaxpr.eqns[step.eqn]
        total = None
        for n in step.unknown:
            t = ev.rule_term(step.rule, step.eqn, n)
            total = ev.add(total, ev.reduce(t, jx.aval(eqn.invars[n]), eqn))
        return total


register_term_rule(Forward, _Zero())
register_term_rule(Tile, _Zero())
register_term_rule(ScanAux, _Zero())
register_term_rule(Solve, _Solve())


def rule_for(step: Any, eqn: Any) -> TermRule:
    """The term rule of ``step``; a step type without one is refused."""
    rule = _RULES.get(type(step))
    if rule is None:
        raise refusal(
            eqn,
            f"revnet derives none through a {type(step).__name__.lower()} step",
        )
    return rule


def has_terms(plan: Plan, jaxpr: Any) -> bool:
    """Whether any step rebuilding ``plan``'s unknown inputs adds a term."""
    for s in needed_steps(plan, jaxpr):
        step = plan.steps[s]
        eqn = jaxpr.eqns[_eqn_of(step)] if _eqn_of(step) is not None else None
        rule = _RULES.get(type(step))
        if rule is None or rule.has_terms(step, eqn):
            return True
    return False


def _eqn_of(step: Any) -> int | None:
    return getattr(step, "eqn", None)


class _Shape:
    """What a handler's ``needs`` reads of an interpreter: the wiring."""

    def __init__(self, plan: Plan, jaxpr: Any):
        self.wiring, self.jaxpr, self.plan = plan.wiring, jaxpr, plan


def needed_steps(plan: Plan, jaxpr: Any) -> list[int]:
    """The indices of the steps the inverse runs to rebuild the unknown inputs,
    in the plan's order."""
    w = plan.wiring
    known = {v for v, k in zip(w.invars, plan.known_in) if k}
    known |= {v for v, k in zip(w.outvars, plan.known_out) if k and v is not None}
    shape = _Shape(plan, jaxpr)
    stack = [plan.producer[v] for v, k in zip(w.invars, plan.known_in) if not k]
    seen: set[int] = set()
    while stack:
        s = stack.pop()
        if s in seen:
            continue
        seen.add(s)
        step = plan.steps[s]
        for v in step_needs(shape, step):
            if v is not None and v not in known and v in plan.producer:
                stack.append(plan.producer[v])
    return sorted(seen)


class Evaluation:
    """One forward evaluation of a jaxpr with its log-determinant.

    Attributes:
      reducer: ``reducer(term, aval, eqn, shape)`` sums a term (an array of the
        solved input's rank, see :mod:`revnet._engine.registry`) to the
        log-determinant's ``shape``: a scalar, or one value per example (the
        program was proved per example before: :func:`evaluate`).
      zero: the log-determinant's zero, of the shape terms reduce to.
      share: None, or inside a ``shard_map`` body ``share(term, avals, eqn)``:
        a reduced term of solved values of types ``avals`` made the sum of its
        distinct copies over the devices
        (:mod:`revnet._engine.structural.shard_map`).
    """

    def __init__(
        self,
        plan: Plan,
        jaxpr: Any,
        reducer: Callable,
        zero: Any,
        share: Callable | None = None,
    ):
        self.plan, self.jaxpr, self.wiring = plan, jaxpr, plan.wiring
        self.reducer, self.zero, self.share = reducer, zero, share
        self.env: dict = {}

    def reduce(self, term: Any, aval: Any, eqn: Any) -> Any:
        """``term``, of a solved value of type ``aval``, summed to the
        log-determinant's shape (and shared, inside a ``shard_map`` body)."""
        term = self.reducer(term, aval, eqn, tuple(self.zero.shape))
        return self.shared(self.like_zero(term), [aval], eqn)

    def like_zero(self, term: Any) -> Any:
        """A reduced term with the log-determinant's Explicit sharding, so that
        a sum carried through a loop keeps its type."""
        return sharded_types.explicit_like(term, jax.typeof(self.zero))

    def shared(self, term: Any, avals: Sequence[Any], eqn: Any) -> Any:
        """A reduced term of solved values of types ``avals`` through
        :attr:`share`; unchanged outside a ``shard_map`` body."""
        return term if self.share is None else self.share(term, avals, eqn)

    def nested(
        self,
        plan: Plan,
        jaxpr: Any,
        args: Sequence[Any],
        zero: Any = None,
        share: Callable | None = None,
    ) -> tuple[list, Any]:
        """:func:`evaluate` for a nested body, with this evaluation's reduction,
        zero and share, or the ``zero`` and ``share`` given (a ``shard_map``
        body's, per device)."""
        zero = self.zero if zero is None else zero
        share = self.share if share is None else share
        return Evaluation(plan, jaxpr, self.reducer, zero, share).run(args)

    def rule_term(self, name: str, i: int, n: int) -> Any:
        """The term of the rule ``name`` for input ``n`` of equation ``i``, at
        the forward values (unreduced); refused for a rule without one."""
        eqn = self.jaxpr.eqns[i]
        rule = registry.get(name)
        if rule.log_det is None:
            raise refusal(eqn, "its inverse rule gives no log-determinant term")
        ins = [self.read_in(i, k) for k in range(len(eqn.invars))]
        outs = [None if v is None else self.env[v] for v in self.wiring.eqn_outs[i]]
        with jx.context(eqn):
            return rule.term(outs, ins, n, eqn.params, [jx.aval(v) for v in eqn.invars])

    def read(self, v: int) -> Any:
        return self.env[v]

    def read_in(self, i: int, n: int) -> Any:
        v = self.wiring.eqn_ins[i][n]
        if v is None:
            return jx.literal_value(self.jaxpr.eqns[i].invars[n])
        return self.env[v]

    @staticmethod
    def add(total: Any, term: Any) -> Any:
        if term is None:
            return total
        return term if total is None else total + term

    def run(self, args: Sequence[Any]) -> tuple[list, Any]:
        """The outputs on ``args`` (every input) and the log-determinant."""
        w, eqns = self.wiring, self.jaxpr.eqns
        self.env.update(zip(w.invars, args))
        steps = [self.plan.steps[s] for s in needed_steps(self.plan, self.jaxpr)]
        live = []
        evaluating: dict[int, tuple[TermRule, Any]] = {}
        for step in steps:
            i = _eqn_of(step)
            eqn = eqns[i] if i is not None else None
            rule = rule_for(step, eqn)
            if not rule.has_terms(step, eqn):
                continue
            if rule.evaluates:
                evaluating[i] = (rule, step)
            else:
                live.append((rule, step))
        total = None
        for i, eqn in enumerate(eqns):
            ins = [self.read_in(i, n) for n in range(len(eqn.invars))]
            if i in evaluating:
                rule, step = evaluating[i]
                outs, term = rule.evaluate(self, step, eqn, ins)
                total = self.add(total, term)
            else:
                outs = apply_eqn(eqn, ins)
            for v, o in zip(w.eqn_outs[i], outs):
                if v is not None:
                    self.env[v] = o
        for rule, step in live:
            total = self.add(total, rule.term(self, step))
        outs = [
            jx.literal_value(a) if v is None else self.env[v]
            for v, a in zip(w.outvars, self.jaxpr.outvars)
        ]
        return outs, self.zero if total is None else total


def elementwise_term(
    ev: Evaluation, var: int, given: int, cone: Sequence[int], aval: Any
) -> Any:
    """``log|d given / d var|``, reduced, for ``given`` computed from ``var``
    position by position by the equations ``cone`` (in order), other values
    read at the forward values; ``aval``: ``var``'s type."""
    eqns = ev.jaxpr.eqns

    def forward(u):
        return run_cone(ev.jaxpr, ev.wiring, cone, {var: u}, ev.read_in)[given]

    u = ev.read(var)
    _, slope = jax.jvp(forward, (u,), (jnp.ones_like(u),))
    return ev.reduce(jnp.log(jnp.abs(slope)), aval, eqns[cone[-1]])


def zero(args: Sequence[Any], shape: tuple, dtype: Any) -> Any:
    """The log-determinant's zero, of ``shape`` (the batch's, or ``()``).

    On the Explicit mesh of the rebuilt arguments ``args``, it is split as the
    first one splits the batch's axes (replicated for a scalar): the type the
    terms have, so that a sum carried through a loop keeps its type.
    """
    z = jnp.zeros(shape, dtype)
    for a in args:
        t = jax.typeof(a)
        spec = sharded_types.explicit_spec(t, len(t.shape))
        if spec is not None:
            split = NamedSharding(t.sharding.mesh, P(*spec[: len(shape)]))
            return jax.sharding.reshard(z, split)
    return z


def evaluate(
    plan: Plan,
    jaxpr: Any,
    args: Sequence[Any],
    reducer: Callable,
    zero: Any,
    batch: tuple | None = None,
    n_out: int | None = None,
    advice: str = "",
) -> tuple[list, Any]:
    """Runs ``jaxpr`` on ``args`` (every input, known or not) and returns its
    outputs and the log-determinant of the map from ``plan``'s unknown inputs
    to its outputs (see :class:`Evaluation` for ``reducer`` and ``zero``).

    With ``batch`` (the batch's shape), the unknown inputs lead with the
    batch's axes and the log-determinant is one per example; the first
    ``n_out`` outputs (all by default) must each depend on their own example
    only, or the program is refused, the message ending with ``advice`` (what
    the caller can change, in the words of its own arguments).

    Raises:
      LogDetError: for a step whose term revnet cannot derive, naming its
        equation and source line.
    """
    if batch is not None:
        n_out = len(jaxpr.outvars) if n_out is None else n_out
        in_flags = [LEADING if not k else UNBATCHED for k in plan.known_in]
        _check_per_example(Tracker(tuple(batch)), jaxpr, in_flags, n_out, advice)
    return Evaluation(plan, jaxpr, reducer, zero).run(args)


def _check_per_example(
    tracker: Tracker, jaxpr: Any, in_flags, n_out: int, advice: str
) -> None:
    """Refuses a program whose first ``n_out`` outputs are not each a function
    of their own example: its Jacobian is not block diagonal by example. Names
    the first equation that mixes examples on the way to such an output (inside
    a ``shard_map``'s body, the body's)."""
    found = tracker.first_mixing(jaxpr, in_flags, range(n_out))
    if found is None:
        return
    eqn, reason = found
    raise refusal(
        eqn,
        "a per-example log-determinant needs each example's outputs to depend "
        "on that example alone, and "
        + (
            reason
            or "this equation mixes the batch's examples (or moves their axis "
            "from the front)"
        )
        + (f"; {advice}" if advice else ""),
    )
