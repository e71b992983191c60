"""jaxpr -> plan, by propagation to a fixed point; one bounded plan cache.

Start with the known inputs (constants) and the outputs known. Then, until
nothing changes, an equation whose inputs are all known is evaluated forward
(any primitive may be), and any other equation is offered to its rule in the
registry (:mod:`revnet._engine.registry`): a primitive's inverse rule solves it
for its one unknown input when its outputs are known; a structural rule (a
nested call, ``scan``, ``select_n``, covering slices) may produce a step of its
own. The order of equations in the jaxpr does not matter. If an input stays
unknown, :class:`~revnet._engine.errors.Stuck` is raised with the failure
that explains it best: a failure waiting for values that other failing
equations could not rebuild (a slice missing its sibling) gives way to those,
then a broken rule comes first, then a refusal, then the one closest to the
inputs.

Plans refer to variables by position only, so :func:`analyze` caches them by
the jaxpr's structure (:func:`revnet._engine.fingerprint.structure`): a
program traced again, eagerly, with new rule objects or weights, is not
analysed again. :data:`stats` counts analyses and cache hits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from revnet._engine import elimination, fingerprint, masks, ratios, registry
from revnet._engine import jaxpr as jx
from revnet._engine.cache import LRU
from revnet._engine.errors import (
    BROKEN,
    ON_STREAM,
    ON_STREAM_PRIMITIVES,
    REFUSED,
    RESIDUAL,
    RESIDUAL_PRIMITIVES,
    STATISTIC,
    STATISTIC_PRIMITIVES,
    WAITING,
    WRAP,
    WRAP_PRIMITIVES,
    Failure,
    NotInvertibleError,
    RuleError,
    Stuck,
    hint_of,
)
from revnet._engine.plan import Forward, Plan, Solve, var_avals, wiring
from revnet._engine.rule_check import abstract_solve

# Elementwise arithmetic and broadcasts, through which a normalisation's
# statistic reaches the stream (:meth:`Analysis._reduction_of`).
_PASS_THROUGH = frozenset(
    {
        *RESIDUAL_PRIMITIVES,
        *("neg", "rsqrt", "sqrt", "square", "integer_pow", "max", "min"),
        *("convert_element_type", "broadcast_in_dim", "reshape", "squeeze"),
        *("expand_dims", "copy", "stop_gradient"),
    }
)

# Values computed from literals only are folded at trace time up to this size.
STATIC_MAX_SIZE = 1 << 20

# Counters for tests and benchmarks: ``analyses`` (full analyses run, nested
# bodies included) and ``hits`` (plans served from the cache).
stats = {"analyses": 0, "hits": 0}


PLAN_CACHE = LRU(512)

# How a residual reads in an error, by primitive.
_OPERATOR = {"sub": "-", "mul": "*", "div": "/"}


def analyze(jaxpr: Any, known_in: Sequence[bool], known_out: Sequence[bool]) -> Plan:
    """The plan rebuilding ``jaxpr``'s unknown inputs; cached by structure.

    Raises:
      Stuck: when an unknown input cannot be rebuilt (never cached: the
        failure names the current jaxpr's equations and source lines).
    """
    key = (
        fingerprint.structure(jaxpr),
        tuple(known_in),
        tuple(known_out),
        registry.version(),
    )
    hit = PLAN_CACHE.get(key)
    if hit is not None:
        stats["hits"] += 1
        return hit
    stats["analyses"] += 1
    plan = Analysis(jaxpr, known_in, known_out).run()
    PLAN_CACHE.put(key, plan)
    return plan


class Analysis:
    """One propagation over one jaxpr; structural rules read and extend it."""

    def __init__(self, jaxpr: Any, known_in: Sequence[bool], known_out: Sequence[bool]):
        self.jaxpr = jaxpr
        self.known_in, self.known_out = tuple(known_in), tuple(known_out)
        self.wiring = wiring(jaxpr)
        self.avals = var_avals(jaxpr)
        w = self.wiring
        self.known: set = {v for v, k in zip(w.invars, known_in) if k}
        self.known |= {v for v, k in zip(w.outvars, known_out) if k and v is not None}
        self.consumers: dict = {}
        self.eqn_of: dict = {}
        for i, (ins, outs) in enumerate(zip(w.eqn_ins, w.eqn_outs)):
            for v in ins:
                if v is not None:
                    self.consumers.setdefault(v, []).append(i)
            for v in outs:
                if v is not None:
                    self.eqn_of[v] = i
        self.steps: list = []
        self.producer: dict = {}
        self.failures: dict[int, Failure] = {}
        self.static: dict = {}  # values computed from literals only
        self.done = [False] * len(jaxpr.eqns)

    # -- queries for rules ----------------------------------------------------- #

    def is_known(self, v: int | None) -> bool:
        return v is None or v in self.known

    def ins_known(self, i: int) -> list[bool]:
        return [self.is_known(v) for v in self.wiring.eqn_ins[i]]

    def static_value(self, i: int, n: int) -> Any:
        """The trace-time value of input ``n`` of equation ``i``, or None."""
        v = self.wiring.eqn_ins[i][n]
        if v is None:
            return jx.literal_value(self.jaxpr.eqns[i].invars[n])
        return self.static.get(v)

    def fail(
        self,
        i: int,
        eqn: Any,
        reason: str,
        inner: Failure | None = None,
        rank: int = REFUSED,
        hint: str | None = None,
        waits_for: Sequence[int] | Callable[[], Sequence[int]] = (),
    ):
        self.failures[i] = Failure(
            eqn, reason, jx.where(eqn), inner, rank, hint, waits_for
        )

    def fail_for_outputs(self, i: int, eqn: Any) -> None:
        """The failure of an equation that needs all its outputs known and has
        some unknown: it waits for them (see :meth:`_cause`)."""
        self.fail(
            i,
            eqn,
            "not all of its outputs are known; an output that does not reach "
            "the function's outputs cannot be used to rebuild its inputs",
            waits_for=[v for v in self.wiring.eqn_outs[i] if not self.is_known(v)],
        )

    def distinct_unknowns(self, i: int, eqn: Any, ins: Sequence[bool]) -> bool:
        """False (and a failure) when one unknown value is used twice."""
        ids = [v for v, k in zip(self.wiring.eqn_ins[i], ins) if not k]
        if len(set(ids)) == len(ids):
            return True
        self.fail(i, eqn, "the same unknown value is used more than once as its input")
        return False

    # -- the propagation ------------------------------------------------------- #

    def run(self) -> Plan:
        self._propagate(range(len(self.jaxpr.eqns) - 1, -1, -1))
        while self._unknown():
            # Stuck: unknowns tied linearly across equations may still be
            # solved together (:mod:`.elimination`), an unknown read twice
            # by a quotient from it (:mod:`.ratios`), and through a mask
            # (:mod:`.masks`).
            found = (
                elimination.eliminate(self)
                or ratios.solve_ratio(self)
                or masks.solve_masked(self, analyze)
            )
            if found is None:
                break
            step, produced = found
            self._propagate(self._next(self._add(step, produced)))
        w = self.wiring
        unknown = self._unknown()
        if unknown:
            # A failure waiting for values gives way to the failing equations
            # that did not rebuild them (its cause). A rule that broke, else a
            # refusal, explains more than an equation stuck for want of known
            # operands (often their consequence); then the failure closest to
            # the inputs.
            best = None
            if self.failures:
                causes = {self._cause(i) for i in self.failures}
                first = min(causes, key=self._order)
                best = self.failures[first]
                if best.rank == WAITING and best.inner is None:
                    self._explain_residual(first, best)
            raise Stuck(best, unknown)
        return Plan(
            w, self.known_in, self.known_out, tuple(self.steps), dict(self.producer)
        )

    def _unknown(self) -> list[int]:
        """The positions of the unknown inputs not rebuilt yet."""
        w = self.wiring
        return [
            n
            for n, (v, k) in enumerate(zip(w.invars, self.known_in))
            if not k and v not in self.known
        ]

    def _propagate(self, equations: Sequence[int]) -> None:
        """Visits ``equations`` (last first), and the equations each value
        they make known may unblock, until nothing changes."""
        queue = list(equations)
        queued = set(queue)
        while queue:
            i = queue.pop()
            queued.discard(i)
            if self.done[i]:
                continue
            for j in self._next(self._visit(i)):
                if j not in queued:
                    queue.append(j)
                    queued.add(j)

    def _next(self, values: Sequence[int]) -> list[int]:
        """The equations not done that read or make ``values``: they may now
        be solvable."""
        found = []
        for v in values:
            for j in [*self.consumers.get(v, ()), self.eqn_of.get(v)]:
                if j is not None and not self.done[j] and j not in found:
                    found.append(j)
        return found

    def _order(self, i: int) -> tuple[int, int]:
        """How well failure ``i`` explains the refusal, best least: by the
        rank of its deepest failure, then closest to the inputs."""
        return self.failures[i].severity(), i

    def _cause(self, i: int) -> int:
        """The failure that explains failure ``i``: itself, or, when it waits
        for values (``Failure.waits_for``), the best of the failing equations
        on the way from those values to the outputs, followed in turn.

        A slice whose sibling stays unknown is not the cause: the equation
        that could not rebuild the sibling is (the residual ``b * (1 + b**2)``
        on the other half of a coupling).
        """
        seen = {i}
        while True:
            blockers = self._blockers(self.failures[i].waiting()) - seen
            if not blockers:
                return i
            i = min(blockers, key=self._order)
            seen.add(i)

    def _blockers(self, values: Sequence[int]) -> set[int]:
        """The failing equations first met on the way from the unknown
        ``values`` through their consumers towards the outputs."""
        found: set[int] = set()
        seen: set[int] = set()
        stack = list(values)
        while stack:
            v = stack.pop()
            if v is None or v in seen or self.is_known(v):
                continue
            seen.add(v)
            for j in self.consumers.get(v, ()):
                if j in self.failures:
                    found.add(j)
                else:
                    stack.extend(self.wiring.eqn_outs[j])
        return found

    def _explain_residual(self, i: int, failure: Failure) -> None:
        """Rewords ``failure`` as a residual ``x + f(x)`` when it is one.

        That is: a binary equation whose unknown operands both depend on one
        unknown value (``x`` and ``f(x)``); two independent unknowns (``a + b``)
        are not a residual.
        """
        if jx.primitive_name(failure.eqn) not in RESIDUAL_PRIMITIVES:
            return
        operands = [v for v in self.wiring.eqn_ins[i] if not self.is_known(v)]
        if len(operands) != 2:
            return
        first, second = (self._unknown_sources(v) for v in operands)
        if not first & second:
            return
        # A shift or scale by a statistic of the stream: a normalisation.
        normalises = jx.primitive_name(failure.eqn) in ("sub", "mul", "div")
        reduction = self._reduction_of(operands) if normalises else None
        if reduction is not None:
            failure.reason = (
                "both operands depend on the same unknown value, one through "
                f"`{reduction}` over it (a statistic of the stream, such as a "
                "normalisation's batch mean or variance), which its output does "
                "not give back"
            )
            failure.hint = STATISTIC
            return
        op = _OPERATOR.get(jx.primitive_name(failure.eqn), "+")
        failure.reason = (
            "both operands depend on the same unknown value, as in a residual "
            f"x {op} f(x), which cannot be solved for x"
        )
        failure.hint = RESIDUAL

    def _reduction_of(self, operands: Sequence[int]) -> str | None:
        """The reduction a normalisation divides or shifts by: the name of
        one found going back from ``operands`` through elementwise
        arithmetic and broadcasts only (``rsqrt(var + eps)``, a mean
        broadcast), or None. A reduction behind a layer (``x + f(norm(x))``,
        where ``f`` holds a matrix product) is not one."""
        stack, seen = list(operands), set()
        while stack:
            u = stack.pop()
            j = self.eqn_of.get(u)
            if u in seen or u in self.known or j is None:
                continue
            seen.add(u)
            name = jx.primitive_name(self.jaxpr.eqns[j])
            if name in STATISTIC_PRIMITIVES:
                return name
            if name in _PASS_THROUGH:
                stack.extend(v for v in self.wiring.eqn_ins[j] if v is not None)
        return None

    def _unknown_sources(self, v: int) -> set[int]:
        """``v`` and the unknown values it is computed from."""
        seen: set[int] = set()
        stack = [v]
        while stack:
            u = stack.pop()
            if u is None or u in seen or u in self.known:
                continue
            seen.add(u)
            j = self.eqn_of.get(u)
            if j is not None:
                stack.extend(self.wiring.eqn_ins[j])
        return seen

    def _add(self, step: Any, produced: Sequence[int | None]) -> list[int]:
        idx = len(self.steps)
        self.steps.append(step)
        fresh = []
        for v in produced:
            if v is None or v in self.known:
                continue
            self.known.add(v)
            self.producer[v] = idx
            fresh.append(v)
        return fresh

    def _settle(self, eqns: Sequence[int]) -> None:
        for j in eqns:
            self.done[j] = True
            self.failures.pop(j, None)

    def _visit(self, i: int) -> list[int]:
        eqn = self.jaxpr.eqns[i]
        ins = self.ins_known(i)
        outs = [v is not None and v in self.known for v in self.wiring.eqn_outs[i]]
        if all(ins):
            self._settle([i])
            if all(k or v is None for k, v in zip(outs, self.wiring.eqn_outs[i])):
                return []
            self._fold(i, eqn)
            return self._add(Forward(i), self.wiring.eqn_outs[i])
        rule = registry.get(jx.primitive_name(eqn))
        if rule is None:
            if any(outs):
                name = jx.primitive_name(eqn)
                reason = f"`{name}` has no inverse rule"
                if name in ON_STREAM_PRIMITIVES:
                    reason += ": it loses information"
                    self.fail(i, eqn, reason, hint=ON_STREAM)
                elif name in WRAP_PRIMITIVES:
                    reason += ": it wraps values into a period"
                    self.fail(i, eqn, reason, hint=WRAP)
                elif name == "optimization_barrier":
                    # A barrier keeps values the forward pass's only (a
                    # layer's new state): never solved through, it is never
                    # why the inputs are not rebuilt.
                    pass
                else:
                    self.fail(i, eqn, reason)
            return []
        if rule.structural:
            found = rule.analyze(self, i, eqn, ins, outs)
        else:
            found = self._solve(rule, i, eqn, ins, outs)
        if found is None:
            return []
        step, produced, eqns = found
        self._settle(eqns)
        return self._add(step, produced)

    def _solve(self, rule: Any, i: int, eqn: Any, ins, outs):
        if not any(outs) or not self.distinct_unknowns(i, eqn, ins):
            return None
        if not all(outs):
            self.fail_for_outputs(i, eqn)
            return None
        try:
            abstract_solve(rule, eqn, ins, lambda n: self.static_value(i, n))
        except RuleError as e:
            self.fail(i, eqn, str(e), rank=BROKEN)
            return None
        except NotInvertibleError as e:
            # A refusal with several unknown inputs may only be waiting for them.
            waiting = sum(not k for k in ins) > 1
            rank = WAITING if waiting else REFUSED
            self.fail(i, eqn, str(e), rank=rank, hint=hint_of(e))
            return None
        unknown = tuple(n for n, k in enumerate(ins) if not k)
        produced = [self.wiring.eqn_ins[i][n] for n in unknown]
        return Solve(i, unknown, rule.name), produced, (i,)

    def _fold(self, i: int, eqn: Any) -> None:
        """Evaluates an equation of literals and static values at trace time."""
        vals = [self.static_value(i, n) for n in range(len(eqn.invars))]
        if any(x is None for x in vals) or eqn.effects:
            return
        if jx.call_body(eqn) is not None or jx.scan_params(eqn) is not None:
            return
        size = sum(int(np.prod(jx.aval(v).shape)) for v in eqn.outvars)
        if size > STATIC_MAX_SIZE:
            return
        try:
            with jax.ensure_compile_time_eval():
                outs = jx.bind(eqn, *vals)
        except Exception:  # not foldable: leave it to run time
            return
        for v, o in zip(self.wiring.eqn_outs[i], outs):
            if v is not None and not isinstance(o, jax.core.Tracer):
                self.static[v] = o
