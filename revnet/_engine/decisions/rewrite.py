"""The decision pass: one walk over a jaxpr that classifies every equation
reading a rebuilt value (:mod:`.continuity`) and rewrites the decisions into
stored outputs (:mod:`.replays` says how each is made and replayed); nested
calls are handled by :class:`~revnet._engine.decisions.nested.NestedCalls`.
:func:`revnet._engine.decisions.expose` is its entry point.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from revnet._engine import exact
from revnet._engine import jaxpr as jx
from revnet._engine.cotangents import is_float_aval
from revnet._engine.decisions import continuity as cont
from revnet._engine.decisions import guards, recompute, replays
from revnet._engine.decisions.nested import NestedCalls, body_tin
from revnet._engine.decisions.record import DECISION_MARK, KINK_MARK, Kept, Result

# Calls whose body may hold decisions that can be stored as extra outputs.
_REMAT = frozenset({"remat", "remat2", "checkpoint"})
_CUSTOM = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})
_STORE_OUTPUTS = frozenset({"round", "floor", "ceil"})


# How many values :meth:`Pass._computes_narrow` follows before it gives up
# (and the cast is stored, as a decision).
_NARROW_SEARCH = 10_000


class Pass:
    """One rewrite of one jaxpr: tracks rebuilt variables, collects decisions
    and kinks. Nested calls are handed to its :class:`NestedCalls`, which
    makes a pass of its own (:meth:`sub`) for each body."""

    def __init__(self, kinks: bool, soft: bool = True, decisions: bool = True):
        self.kinks, self.soft, self.decisions = kinks, soft, decisions
        self.nested = NestedCalls(self.sub)
        # Of the jaxpr being run: which variables are rebuilt, the equation
        # making each variable, the uses of each, and those differentiated.
        self.taint: dict = {}
        self.producer: dict = {}
        self.uses: dict = collections.defaultdict(list)
        self.graded: set = set()
        # Rebuilt variables and the stored copies of their forward values
        # (``_at_point``), and the rewritten equation making each variable.
        self.copies: dict = {}
        self.made: dict = {}

    def sub(self) -> Pass:
        """A pass with the same options, for a nested body."""
        return Pass(self.kinks, self.soft, self.decisions)

    def run(self, jaxpr: Any, rebuilt: Sequence[bool]) -> Result:
        """The rewritten equations of ``jaxpr``, its stored decisions (extra
        outputs, made by those equations) and which outputs are rebuilt."""
        taint = dict(zip(jaxpr.invars, rebuilt))
        eqns, outvars = self._flatten(jaxpr, taint)
        self.producer = {v: e for e in eqns for v in e.outvars if not jx.is_dropvar(v)}
        for e in eqns:
            for n, a in enumerate(e.invars):
                if not jx.is_literal(a):
                    self.uses[a].append((e, n))
        for a in outvars:
            if not jx.is_literal(a):
                self.uses[a].append((None, 0))
        self.graded = _differentiated(eqns, outvars)
        self.taint = taint
        sub: dict = {}
        new: list = []
        extra: list = []
        kept: list = []

        def atom(a):
            return a if jx.is_literal(a) else sub.get(a, a)

        for e0 in eqns:
            e = e0.replace(invars=[atom(a) for a in e0.invars])
            tin = [self.tainted(a) for a in e.invars]
            if not any(tin):
                new.append(e)
                self._made([e])
                for v in e.outvars:  # exact (``_flatten`` over-approximated)
                    if not jx.is_dropvar(v) and not jx.is_ref(v):
                        taint[v] = False
                continue
            more, stored, why, outs, tout = self._eqn(e, e0, tin)
            for a in e.invars:  # a reference written with a rebuilt value
                if jx.is_ref(a):
                    taint[a] = True
            new.extend(more)
            self._made(more)
            extra.extend(stored)
            kept.extend(why)
            for ne in more:  # spliced variables are rebuilt unless stored
                for v in ne.outvars:
                    if not jx.is_dropvar(v):
                        taint.setdefault(v, not any(v is d for d in stored))
            for v, o, t in zip(e.outvars, outs, tout):
                if jx.is_dropvar(v):
                    continue
                if o is not v:
                    sub[v] = o
                taint[v] = t
                if not jx.is_literal(o):
                    taint[o] = t
        outvars = [atom(a) for a in outvars]
        fused = self.nested.fused(new)
        tout = [self.tainted(a) for a in outvars]
        return Result(new, fused, outvars, extra, kept, tout)

    def _made(self, eqns: Sequence[Any]) -> None:
        for e in eqns:
            for v in e.outvars:
                if not jx.is_dropvar(v):
                    self.made[v] = e

    def tainted(self, a) -> bool:
        """Whether ``a`` is a rebuilt float: rebuilt integers and booleans are
        exact (any made from a rebuilt float came from a stored decision)."""
        return (
            not jx.is_literal(a)
            and self.taint.get(a, False)
            and is_float_aval(jx.aval(a))
        )

    # -- calls inlined before classifying ------------------------------------ #

    def _flatten(self, jaxpr: Any, taint: dict) -> tuple[list, list]:
        """``jaxpr``'s equations with the calls :meth:`_inlinable` names
        inlined (so that a comparison and the select reading it are seen
        together), and its outputs; ``taint`` is over-approximated here."""
        sub: dict = {}
        out: list = []

        def atom(a):
            return a if jx.is_literal(a) else sub.get(a, a)

        work = collections.deque(jaxpr.eqns)
        while work:
            e = work.popleft()
            e = e.replace(invars=[atom(a) for a in e.invars])
            tin = [not jx.is_literal(a) and taint.get(a, False) for a in e.invars]
            if any(tin) and self._inlinable(e, tin):
                inner, outs = jx.inline_body(jx.call_body(e), e.invars, e.source_info)
                for v, o in zip(e.outvars, outs):
                    if not jx.is_dropvar(v):
                        sub[v] = atom(o)
                work.extendleft(reversed(inner))
                continue
            out.append(e)
            for v in e.outvars:
                if not jx.is_dropvar(v):
                    taint[v] = any(tin)
        return out, [atom(a) for a in jaxpr.outvars]

    def _inlinable(self, e: Any, tin: list[bool]) -> bool:
        """Whether ``e`` is a call to inline: a ``jit`` (those left after
        tracing have constants), or revnet's own ``scan`` (its primal body) or
        a ``remat`` with constants whose body stores decisions."""
        name = jx.primitive_name(e)
        body = jx.call_body(e)
        if body is None:
            return False
        if jx.plain_call_jaxpr(e) is not None:
            return True
        ours = jx.tag_kind(e) == "scan"
        if not ours and not (name in _REMAT and body.consts):
            return False
        nb = len(body.consts)
        return bool(self.sub().run(body.jaxpr, [False] * nb + tin).extra)

    # -- one equation --------------------------------------------------------- #

    def _eqn(self, e: Any, e0: Any, tin: list[bool]):
        """``(equations replacing e, stored variables, their records, atoms of
        e's outputs, whether each output is rebuilt)``; ``e0`` is ``e`` before
        substitution, as the use map knows it."""
        name = jx.primitive_name(e)
        same, rebuilt = list(e.outvars), [True] * len(e.outvars)
        keep = [e], [], [], same, rebuilt
        outs = [v for v in e.outvars if not jx.is_dropvar(v)]
        # Results nothing reads (a while loop's float carry, when only its
        # counter is used) do not make the equation continuous.
        used = [v for v, v0 in zip(e.outvars, e0.outvars) if self.uses.get(v0)]
        float_in = any(t and is_float_aval(jx.aval(a)) for t, a in zip(tin, e.invars))
        if float_in and used and not any(is_float_aval(jx.aval(v)) for v in used):
            outs = used
            cls = cont.classify(e)
            if cls == cont.GUARD and guards.nonfinite_at_tie(e0, self.producer.get):
                cls = cont.DECISION  # a NaN made at a tie (0/0): it jumps there
            if cls == cont.GUARD:
                return keep
            if cls == cont.DECISION and self._soft(e0):
                return keep  # a kink: predicate of selects continuous there
            kink = cls == cont.DECISION and self._continuous(e0)
            if not self.decisions and not kink:
                return keep  # a decision, made again (decisions="recompute")
            return self._outputs(e, outs, "kink" if kink else "decision")
        if _marked(e, DECISION_MARK):
            return self._outputs(e, outs) if self.decisions else keep
        if name == "scan":
            return self.nested.scan(e, tin)
        if name in _REMAT:
            return self.nested.remat(e, tin)
        if name == "cond":
            return self.nested.cond(e, tin)
        if name == "while":
            return self.nested.while_loop(e, tin)
        if jx.shard_map_params(e) is not None:
            return self.nested.shard_map(e, tin)
        if not float_in:
            return keep
        if name in _CUSTOM or jx.custom_rule_kind(e) is not None:
            return self._custom(e, tin)
        if jx.call_body(e) is not None:  # other calls: classified in their body
            r = self.sub().run(jx.call_body(e).jaxpr, body_tin(e, tin))
            if r.extra:
                return self._at_point(e, tin, "inputs")
            return keep
        cls = cont.classify(e)
        if cls in (cont.SMOOTH, cont.GUARD, cont.STRUCTURAL):
            return keep
        if cont.narrowing_float_cast(e) and (
            self._computes_narrow(e0) or self._rounds_back(e0)
        ):
            return keep  # rounding into a computation in the narrow dtype
        if cls == cont.KINK:
            if not self.kinks or not any(v in self.graded for v in e0.outvars):
                return keep
            if name in ("max", "min", "abs"):
                return self._split(e, *replays.kink(e, name), "kink")
            return self._at_point(e, tin, "kink")
        if not self.decisions:
            return keep  # a decision, made again (decisions="recompute")
        if name in ("top_k", "approx_top_k"):
            return self._split(e, *replays.top_k(e), "decision")
        if name == "sort":
            return self._split(e, *replays.sort(e), "decision")
        if name == "sign" and jnp.issubdtype(jx.aval(e.outvars[0]).dtype, jnp.floating):
            return self._split(e, *replays.sign(e), "decision")
        if name in _STORE_OUTPUTS:
            return self._outputs(e, outs)
        return self._at_point(e, tin, "inputs")

    def _computes_narrow(self, cast: Any) -> bool:
        """Whether the rounding ``cast`` feeds a computation in its narrow
        dtype (mixed precision), not a quantisation read back in a wider one.

        Its narrow result may be widened on the way (a LayerNorm or a sum
        accumulating in float32) if every value computed from the widened
        one is rounded again to a dtype no wider than the narrow one before
        it reaches an output; a widened value that reaches an output in the
        wider dtype makes the rounding a quantisation step, a decision.
        """
        narrow = cast.params["new_dtype"]
        todo = [
            v
            for use, _ in self.uses.get(cast.outvars[0], [])
            if use is not None and cont.widening_float_cast(use)
            for v in use.outvars
        ]
        seen: set = set()
        while todo:
            v = todo.pop()
            if id(v) in seen:
                continue
            seen.add(id(v))
            if len(seen) > _NARROW_SEARCH:
                return False
            for use, _ in self.uses.get(v, []):
                if use is None:
                    return False
                if cont.rounds_to(use, narrow):
                    continue
                todo.extend(
                    o
                    for o in use.outvars
                    if not jx.is_dropvar(o) and is_float_aval(jx.aval(o))
                )
        return True

    def _rounds_back(self, cast: Any) -> bool:
        """Whether the rounding ``cast`` ends a stretch of a narrow
        computation done wider: every rebuilt value it reads comes from
        values widened from its narrow dtype (a LayerNorm of ``bfloat16``
        accumulating in float32, rounding its result back)."""
        narrow = cast.params["new_dtype"]
        todo, seen = [cast.invars[0]], set()
        while todo:
            v = todo.pop()
            if jx.is_literal(v) or not self.tainted(v) or id(v) in seen:
                continue
            seen.add(id(v))
            e = self.producer.get(v)
            if e is None or len(seen) > _NARROW_SEARCH:
                return False  # a rebuilt input of the program, read wide
            if cont.widening_float_cast(e) and cont.rounds_to(e, narrow, src=True):
                continue
            todo.extend(a for a in e.invars if is_float_aval(jx.aval(a)))
        return True

    def _outputs(self, e, outs, reason: str = "decision"):
        """``e`` kept, its results ``outs`` stored (or made again from stored
        copies of its inputs, :meth:`_exact`)."""
        same = list(e.outvars)
        exact = self._exact(e.invars, e.source_info)
        if exact is not None:
            eqns, ins = exact
            return [*eqns, e.replace(invars=ins)], [], [], same, [False] * len(same)
        return [e], outs, self._why(e, reason, len(outs)), same, [False] * len(same)

    def _exact(self, atoms: Sequence[Any], source_info: Any):
        """:func:`.recompute.forward_values` of ``atoms`` in this pass."""
        return recompute.forward_values(
            atoms, self.tainted, self.copies, self.made, source_info
        )

    def _why(self, e, reason: str, n: int, within=()) -> list[Kept]:
        name, call = jx.primitive_name(e), jx.call_name(e)
        return [Kept(reason, name, jx.where(e), tuple(within), call)] * n

    def _soft(self, cmp: Any) -> bool:
        """Whether the comparison ``cmp`` only decides selects that are
        continuous where it switches (so it is a kink, recomputed)."""
        return not self.kinks and self.soft and self._continuous(cmp)

    def _continuous(self, cmp: Any) -> bool:
        """Whether ``cmp`` is a comparison that only decides selects that are
        continuous where it switches (marked kinks, ``leaky_relu``)."""
        if not cont.is_comparison(cmp):
            return False
        uses = self.uses.get(cmp.outvars[0], [])
        if uses and all(_marked(use, KINK_MARK) for use, _ in uses):
            return True
        sw = cont.switch_point(cmp, self.tainted, self.producer.get)
        if sw is None:
            return False
        u, c = sw
        return bool(uses) and all(
            use is not None
            and n == 0
            and jx.primitive_name(use) == "select_n"
            and cont.continuous_at_switch(use, u, c, self.producer.get)
            for use, n in uses
        )

    def _split(self, e, decide, values, own, reason):
        """``e`` as a stored decision (``decide``) and ``values`` computed by it.

        ``own``: the position of ``e``'s output that is the decision itself
        (``top_k``'s indices), or None.
        """
        ins = list(e.invars)
        exact = self._exact(ins, e.source_info)
        made, at = ([], ins) if exact is None else exact
        eqns, (d,) = jx.splice(decide, at, e.source_info)
        more, outs = jx.splice(values, [*ins, d], e.source_info)
        outs = list(outs)
        if own is not None:
            outs.insert(own, d)
        rebuilt = [o is not d for o in outs]
        n = len(e.outvars)
        stored, why = ([d], self._why(e, reason, 1)) if exact is None else ([], [])
        return made + eqns + more, stored, why, outs[:n], rebuilt[:n]

    def _at_point(self, e, tin, reason):
        """``e`` evaluated at stored copies of its rebuilt float inputs."""
        pos = [
            n
            for n, (t, a) in enumerate(zip(tin, e.invars))
            if t and is_float_aval(jx.aval(a))
        ]
        decide, values = replays.at_point(e, pos)
        rebuilt = [e.invars[n] for n in pos]
        exact = self._exact(rebuilt, e.source_info)
        if exact is None:
            copy_eqns, copies = jx.splice(decide, rebuilt, e.source_info)
            stored, why = list(copies), self._why(e, reason, len(copies))
            self.copies.update(zip(rebuilt, copies))
        else:
            (copy_eqns, copies), stored, why = exact, [], []
        more, outs = jx.splice(values, [*e.invars, *copies], e.source_info)
        forward = [False] * len(e.outvars)  # the forward values, exactly
        return copy_eqns + more, stored, why, list(outs), forward

    # -- nested jaxprs -------------------------------------------------------- #

    def _custom(self, e, tin):
        """A ``custom_jvp``/``custom_vjp`` function: its derivative is its own
        rule's, so a decision (or, with ``kinks="store"``, a kink) in its body
        is replayed by evaluating the whole call at its stored inputs. A
        ``custom_ivjp`` function is inverted by the user's inverse instead
        (:meth:`NestedCalls.custom_ivjp`)."""
        if jx.tag_kind(e) == "custom_ivjp":
            return self.nested.custom_ivjp(e, tin)
        body = jx.call_body(e)
        keep = [e], [], [], list(e.outvars), [True] * len(e.outvars)
        if exact.is_exact(e):
            return keep  # revnet.exact: its inputs are rebuilt bit for bit
        if body is None:
            return self._at_point(e, tin, "inputs")
        r = self.sub().run(body.jaxpr, body_tin(e, tin))
        if not r.extra:
            return keep
        if self.kinks and _is_relu(e):
            return self._split(e, *replays.kink(e, "relu"), "kink")
        reason = "inputs" if any(k.reason != "kink" for k in r.kept) else "kink"
        return self._at_point(e, tin, reason)


def _differentiated(eqns: Sequence[Any], outvars: Sequence[Any]) -> set:
    """The variables whose derivative reaches ``outvars`` (not through
    ``stop_gradient`` or an equation without float results)."""
    live = {a for a in outvars if not jx.is_literal(a)}
    for e in reversed(list(eqns)):
        if jx.primitive_name(e) == "stop_gradient" or jx.has_zero_derivative(e):
            continue
        if not any(v in live for v in e.outvars if not jx.is_dropvar(v)):
            continue
        if not any(is_float_aval(jx.aval(v)) for v in e.outvars):
            continue
        live.update(a for a in e.invars if not jx.is_literal(a))
    return live


def _marked(e, mark: str) -> bool:
    """Whether ``e`` is the mark ``mark`` of :mod:`revnet.marks`."""
    return (
        e is not None
        and jx.primitive_name(e) == "custom_jvp_call"
        and jx.call_name(e) == mark
    )


def _is_relu(e) -> bool:
    """Whether ``e`` is ``jax.nn.relu`` (a ``custom_jvp`` of one input)."""
    return (
        jx.primitive_name(e) == "custom_jvp_call"
        and jx.call_name(e) == "relu"
        and len(e.invars) == 1
        and len(e.outvars) == 1
    )
