"""Decisions: results that jump, stored by the forward pass at any depth.

The backward pass evaluates a function's equations again on *rebuilt* values,
which differ from the forward values by rounding. Most equations do not care:
their results move by as little as their inputs. A **decision** does: its
value jumps, so near a tie (``b > 0`` with ``b`` about zero, equal logits in an
``argmax``, a half-integer under ``round``, a multiple of the modulus under
``rem``) the rebuilt input can land on the other side, the gradient then
follows the branch the forward pass did not take, and the rebuilt inputs
themselves are wrong from there on. :mod:`revnet._engine.continuity` says
which equations are decisions, kinks, guards or smooth.

:func:`expose` rewrites a jaxpr so that every decision reading a rebuilt value
becomes an extra output, which the forward pass saves and the backward pass
reads instead of deciding again. What is stored depends on the decision
(:mod:`revnet._engine.replays`): a comparison's or an index's result; the
indices of ``top_k``; a ``sort``'s permutation; for any other jump (``rem``,
``reduce_precision``, a narrowing cast, a ``custom_jvp`` function whose body
decides) the equation's rebuilt inputs, at which the backward pass evaluates
it and its derivative. An equation reading a rebuilt float whose results are
all integers (``jnp.searchsorted``, ``jnp.digitize``) is stored whole.

**At any depth.** A decision inside a ``scan`` body, a ``remat``/checkpoint
body or a ``cond`` branch is stored too. The call is split in two: a
*deciding* call that returns the decisions (stacked per step for a scan), and
a *replaying* call that takes them as inputs in place of the equations that
made them. The forward pass runs both; the backward pass, which knows the
decisions, runs only the replaying call on rebuilt values. A decision inside
a ``while`` loop, whose steps are not counted, is refused in one line, as is
one inside a ``shard_map``.

A select whose cases agree where its predicate switches (``leaky_relu``,
``elu``, ``hard_tanh``) is a **kink**, and NaN/Inf tests are **guards**:
neither is stored by default. Kinks (``max``, ``min``, ``abs``, ``relu``,
``clamp``, reductions, pooling, ``cummax``) are recomputed by default, since a
stored mask per layer costs memory; with ``kinks="store"`` they are stored
too, and the backward pass differentiates them as ``jax.grad`` does at the
forward values, ties included. Kinks whose derivative is never used (under
``stop_gradient``, as the maximum inside ``jax.nn.softmax``) are not stored.

Each stored value is described by a :class:`Kept` record: what it is, which
equation and source line made it, and inside which loops.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from revnet._engine import continuity as cont
from revnet._engine import jaxpr as jx
from revnet._engine import replays
from revnet._engine.cotangents import is_float_aval

# The names of revnet.marks' marks (custom_jvp identities of one boolean).
DECISION_MARK = "revnet_decision"
KINK_MARK = "revnet_kink"

DECISIONS = ("store", "recompute")
KINKS = ("recompute", "store")

# Calls whose body may hold decisions that can be stored as extra outputs.
_REMAT = frozenset({"remat", "remat2", "checkpoint"})
_CUSTOM = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})
_STORE_OUTPUTS = frozenset({"round", "floor", "ceil"})


@dataclasses.dataclass(frozen=True)
class Kept:
    """One value the forward pass stores for the backward pass.

    Attributes:
      reason: ``"decision"`` (a result that jumps, or what decides it),
        ``"kink"`` (the branch of a kink, with ``kinks="store"``) or
        ``"inputs"`` (an equation's rebuilt inputs, at which the backward
        pass evaluates it).
      primitive: the primitive of the equation it is kept for.
      where: the user's source line of that equation, or ``""``.
      within: the loops and calls it sits in, outermost first (``"scan"``,
        ``"checkpoint"``, ``"cond"``); a ``scan`` stacks it once per step.
    """

    reason: str
    primitive: str
    where: str
    within: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Exposed:
    """A jaxpr whose stored decisions are extra outputs.

    Attributes:
      jaxpr: the rewritten jaxpr: the original outputs, then ``n`` decisions.
      n: how many decision outputs were appended (0: ``jaxpr`` is the input).
      kept: one record per appended output.
    """

    jaxpr: Any
    n: int
    kept: tuple[Kept, ...] = ()


def check_options(decisions: str, kinks: str, where: str) -> None:
    """Raises a one-line ValueError for an unknown ``decisions``/``kinks``."""
    if decisions not in DECISIONS:
        raise ValueError(
            f"{where}: decisions must be one of {DECISIONS}, got {decisions!r}"
        )
    if kinks not in KINKS:
        raise ValueError(f"{where}: kinks must be one of {KINKS}, got {kinks!r}")


def expose(
    jaxpr: Any,
    rebuilt: Sequence[bool],
    *,
    decisions: str = "store",
    kinks: str = "recompute",
    soft: bool = True,
) -> Exposed:
    """Appends the decisions that read rebuilt values to ``jaxpr``'s outputs.

    Args:
      jaxpr: an open jaxpr (constants as leading inputs).
      rebuilt: for each input, whether the backward pass rebuilds it (the
        function's arguments, a loop's carry) rather than knowing it exactly.
      decisions: ``"store"``, or ``"recompute"`` to leave ``jaxpr`` as it is.
      kinks: ``"store"`` to store the branch of every kink too.
      soft: False to store the predicates of continuous selects too: a select
        on the inverted path (``where(x > 0, 2 * x, x / 2)`` of the stream) is
        solved for its cases only with its predicate known. Callers retry with
        False when the analysis is stuck.

    Returns:
      The rewritten jaxpr, the number of appended outputs and what each is;
      with none, the very same jaxpr.

    Raises:
      ValueError: for a decision that cannot be stored where it sits (inside
        a ``while`` loop or a ``shard_map``), naming it and what to do.
    """
    if decisions == "recompute":
        return Exposed(jaxpr, 0)
    r = _Pass(kinks == "store", soft).run(jaxpr, list(rebuilt))
    if not r.extra:
        return Exposed(jaxpr, 0)
    new = jx.with_outputs(jaxpr, [*r.outvars, *r.extra], r.eqns)
    return Exposed(new, len(r.extra), tuple(r.kept))


def stored_bytes(exposed: Exposed) -> int:
    """Bytes of the decisions a call of an exposed jaxpr stores."""
    outs = exposed.jaxpr.outvars[len(exposed.jaxpr.outvars) - exposed.n :]
    return sum(
        int(np.prod(jx.aval(v).shape, dtype=np.int64))
        * np.dtype(jx.aval(v).dtype).itemsize
        for v in outs
    )


@dataclasses.dataclass
class _Result:
    eqns: list
    outvars: list
    extra: list
    kept: list
    tout: list


def _refuse(what: str, inner: Any, outer: Any, fix: str) -> ValueError:
    where = jx.where(inner) or jx.where(outer)
    at = f" at {where}" if where else ""
    return ValueError(
        f"a decision (`{jx.primitive_name(inner)}`{at}) inside {what} reads values "
        f"the backward pass rebuilds, and {fix}; or pass decisions='recompute' "
        "(a recomputed decision may flip near a tie)"
    )


class _Pass:
    """One rewrite: tracks which variables are rebuilt, collects decisions."""

    def __init__(self, kinks: bool, soft: bool = True):
        self.kinks, self.soft = kinks, soft

    def sub(self) -> _Pass:
        """A pass with the same options, for a nested body."""
        return _Pass(self.kinks, self.soft)

    def run(self, jaxpr: Any, rebuilt: Sequence[bool]) -> _Result:
        """The rewritten equations of ``jaxpr``, its stored decisions (extra
        outputs, made by those equations) and which outputs are rebuilt."""
        taint = dict(zip(jaxpr.invars, rebuilt))
        eqns, outvars = self._flatten(jaxpr, taint)
        self.producer = {v: e for e in eqns for v in e.outvars if not jx.is_dropvar(v)}
        self.uses: dict = collections.defaultdict(list)
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
                continue
            more, stored, why, outs, tout = self._eqn(e, e0, tin)
            new.extend(more)
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
        return _Result(new, outvars, extra, kept, [self.tainted(a) for a in outvars])

    def tainted(self, a) -> bool:
        return not jx.is_literal(a) and self.taint.get(a, False)

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
        if name in jx.JIT_NAMES:
            return True
        tag = jx.tag_of(e)
        ours = tag is not None and getattr(tag, "loop_kind", None) == "scan"
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
            if cls == cont.GUARD:
                return keep
            if cls == cont.DECISION and self._soft(e0):
                return keep  # a kink: predicate of selects continuous there
            return (
                [e],
                outs,
                self._why(e, "decision", len(outs)),
                same,
                [False] * len(same),
            )
        if _marked(e, DECISION_MARK):
            return [e], outs, self._why(e, "decision", 1), same, [False] * len(same)
        if name == "scan":
            return self._scan(e, tin)
        if name in _REMAT:
            return self._remat(e, tin)
        if name == "cond":
            return self._cond(e, tin)
        if name == "while":
            return self._while(e, tin)
        if jx.shard_map_params(e) is not None:
            return self._shard_map(e, tin)
        if not float_in:
            return keep
        if name in _CUSTOM or jx.custom_rule_kind(e) is not None:
            return self._custom(e, tin)
        if jx.call_body(e) is not None:  # other calls: classified in their body
            r = self.sub().run(jx.call_body(e).jaxpr, self._body_tin(e, tin))
            if r.extra:
                return self._at_point(e, tin, "inputs")
            return keep
        cls = cont.classify(e)
        if cls in (cont.SMOOTH, cont.GUARD, cont.STRUCTURAL):
            return keep
        if cls == cont.KINK:
            if not self.kinks or not any(v in self.graded for v in e0.outvars):
                return keep
            if name in ("max", "min", "abs"):
                return self._split(e, *replays.kink(e, name), "kink")
            return self._at_point(e, tin, "kink")
        if name in ("top_k", "approx_top_k"):
            return self._split(e, *replays.top_k(e), "decision")
        if name == "sort":
            return self._split(e, *replays.sort(e), "decision")
        if name == "sign" and jnp.issubdtype(jx.aval(e.outvars[0]).dtype, jnp.floating):
            return self._split(e, *replays.sign(e), "decision")
        if name in _STORE_OUTPUTS:
            return (
                [e],
                outs,
                self._why(e, "decision", len(outs)),
                same,
                [False] * len(same),
            )
        return self._at_point(e, tin, "inputs")

    def _why(self, e, reason: str, n: int, within=()) -> list[Kept]:
        return [Kept(reason, jx.primitive_name(e), jx.where(e), tuple(within))] * n

    def _soft(self, cmp: Any) -> bool:
        """Whether the comparison ``cmp`` only decides selects that are
        continuous where it switches (so it is a kink, recomputed)."""
        if self.kinks or not self.soft or not cont.is_comparison(cmp):
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
        eqns, (d,) = jx.splice(decide, ins, e.source_info)
        more, outs = jx.splice(values, [*ins, d], e.source_info)
        outs = list(outs)
        if own is not None:
            outs.insert(own, d)
        rebuilt = [o is not d for o in outs]
        n = len(e.outvars)
        return eqns + more, [d], self._why(e, reason, 1), outs[:n], rebuilt[:n]

    def _at_point(self, e, tin, reason):
        """``e`` evaluated at stored copies of its rebuilt float inputs."""
        pos = [
            n
            for n, (t, a) in enumerate(zip(tin, e.invars))
            if t and is_float_aval(jx.aval(a))
        ]
        decide, values = replays.at_point(e, pos)
        copy_eqns, copies = jx.splice(decide, [e.invars[n] for n in pos], e.source_info)
        more, outs = jx.splice(values, [*e.invars, *copies], e.source_info)
        rebuilt = [False] * len(e.outvars)  # the forward values, exactly
        why = self._why(e, reason, len(copies))
        return copy_eqns + more, list(copies), why, list(outs), rebuilt

    # -- nested jaxprs -------------------------------------------------------- #

    def _body_tin(self, e, tin) -> list[bool]:
        return [False] * len(jx.call_body(e).consts) + list(tin)

    def _custom(self, e, tin):
        """A ``custom_jvp``/``custom_vjp`` function: its derivative is its own
        rule's, so a decision (or, with ``kinks="store"``, a kink) in its body
        is replayed by evaluating the whole call at its stored inputs."""
        body = jx.call_body(e)
        keep = [e], [], [], list(e.outvars), [True] * len(e.outvars)
        if body is None:
            return self._at_point(e, tin, "inputs")
        r = self.sub().run(body.jaxpr, self._body_tin(e, tin))
        if not r.extra:
            return keep
        if self.kinks and _is_relu(e):
            return self._split(e, *replays.kink(e, "relu"), "kink")
        reason = "inputs" if any(k.reason != "kink" for k in r.kept) else "kink"
        return self._at_point(e, tin, reason)

    def _nested(self, body: Any, rebuilt: list[bool]):
        """``(result, deciding body, replaying body)`` of a nested jaxpr."""
        r = self.sub().run(body, rebuilt)
        if not r.extra:
            return r, None, None
        deciding = jx.with_outputs(body, [*r.outvars, *r.extra], r.eqns)
        live = jx.live_equations(r.eqns, r.outvars, r.extra)
        replaying = jx.with_inputs(body, [*body.invars, *r.extra], live, r.outvars)
        return r, deciding, replaying

    def _scan(self, e, tin):
        sp = jx.scan_params(e)
        nb, nc, ncar = len(sp.body.consts), sp.num_consts, sp.num_carry
        body = sp.body.jaxpr
        carry = list(tin[nc : nc + ncar])
        while True:  # the carry's taint, to a fixed point
            rebuilt = [False] * nb + tin[:nc] + carry + tin[nc + ncar :]
            tout = self.sub().run(body, rebuilt).tout
            new = [c or t for c, t in zip(carry, tout[:ncar])]
            if new == carry:
                break
            carry = new
        r, deciding, replaying = self._nested(body, rebuilt)
        tout = [*carry, *r.tout[ncar:]]
        if deciding is None:
            return [e], [], [], list(e.outvars), tout
        stacked = [jx.new_var(jx.stacked(jx.aval(v), sp.length)) for v in r.extra]
        unused = [jx.new_var(jx.aval(v)) for v in e.outvars]
        decide = jx.scan_with_body(e, deciding, nb, [*unused, *stacked])
        replay = jx.scan_with_body(e, replaying, nb, e.outvars, more_xs=stacked)
        why = [dataclasses.replace(k, within=("scan", *k.within)) for k in r.kept]
        return [decide, replay], stacked, why, list(e.outvars), tout

    def _remat(self, e, tin):
        body = jx.call_body(e)
        r, deciding, replaying = self._nested(body.jaxpr, self._body_tin(e, tin))
        if deciding is None:  # (with constants and decisions it was inlined)
            return [e], [], [], list(e.outvars), r.tout
        outs = [jx.new_var(jx.aval(v)) for v in r.extra]
        unused = [jx.new_var(jx.aval(v)) for v in e.outvars]
        decide = jx.remat_with_body(e, deciding, [*unused, *outs])
        replay = jx.remat_with_body(e, replaying, e.outvars, more_ins=outs)
        why = [dataclasses.replace(k, within=("checkpoint", *k.within)) for k in r.kept]
        return [decide, replay], outs, why, list(e.outvars), r.tout

    def _cond(self, e, tin):
        """A ``cond``: each branch stores its own decisions; the deciding call
        returns zeros in the slots of the other branches'."""
        branches = jx.cond_branches(e)
        done = [
            self._nested(b.jaxpr, [False] * len(b.consts) + tin[1:]) for b in branches
        ]
        tout = [tin[0] or any(t) for t in zip(*[r.tout for r, _, _ in done])]
        if all(d is None for _, d, _ in done):
            return [e], [], [], list(e.outvars), tout
        slots = [jx.new_var(jx.aval(v)) for r, _, _ in done for v in r.extra]
        deciding, replaying, at = [], [], 0
        for b, (r, _, _) in zip(branches, done):
            n, nb = len(r.extra), len(b.consts)
            mine = range(at, at + n)
            others = [v for k, v in enumerate(slots) if k not in mine]
            zeros, zs = jx.splice(
                lambda: [jnp.zeros(v.aval.shape, v.aval.dtype) for v in others],
                [],
                e.source_info,
            )
            zs = iter(zs)
            outs = [
                r.extra[k - at] if k in mine else next(zs) for k in range(len(slots))
            ]
            body = b.jaxpr
            deciding.append(
                (jx.with_outputs(body, [*r.outvars, *outs], [*r.eqns, *zeros]), nb)
            )
            ins = [
                r.extra[k - at] if k in mine else jx.new_var(v.aval)
                for k, v in enumerate(slots)
            ]
            live = jx.live_equations(r.eqns, r.outvars, r.extra)
            replaying.append(
                (jx.with_inputs(body, [*body.invars, *ins], live, r.outvars), nb)
            )
            at += n
        unused = [jx.new_var(jx.aval(v)) for v in e.outvars]
        decide = jx.cond_with_branches(e, deciding, e.invars, [*unused, *slots])
        replay = jx.cond_with_branches(e, replaying, [*e.invars, *slots], e.outvars)
        why = [
            dataclasses.replace(k, within=("cond", *k.within))
            for r, _, _ in done
            for k in r.kept
        ]
        return [decide, replay], slots, why, list(e.outvars), tout

    def _while(self, e, tin):
        """A ``while`` loop: its trip count is read at run time, so a decision
        in its body or condition cannot be stored per step, and is refused."""
        cond, cn, body, bn = jx.while_bodies(e)
        consts_c, consts_b = tin[:cn], tin[cn : cn + bn]
        carry = list(tin[cn + bn :])
        while True:
            rebuilt = [False] * len(body.consts) + consts_b + carry
            r = self.sub().run(body.jaxpr, rebuilt)
            new = [c or t for c, t in zip(carry, r.tout)]
            if new == carry:
                break
            carry = new
        rc = self.sub().run(cond.jaxpr, [False] * len(cond.consts) + consts_c + carry)
        for res, what in ((r, "a while_loop body"), (rc, "a while_loop condition")):
            if res.extra:
                inner = _maker(res, e)
                raise _refuse(
                    what,
                    inner,
                    e,
                    "a while loop cannot store one per step: use lax.fori_loop with "
                    "static bounds or lax.scan, whose decisions are stored per step",
                )
        return [e], [], [], list(e.outvars), carry

    def _shard_map(self, e, tin):
        """A ``shard_map`` is kept; a decision in its body is refused in one line.

        Its per-device decisions would need outputs of their own specs; until
        then, a decision reading rebuilt values there must not be recomputed
        silently.
        """
        body = jx.shard_map_params(e).body
        r = self.sub().run(body.jaxpr, [False] * len(body.consts) + tin)
        if r.extra:
            raise _refuse(
                "a shard_map body",
                _maker(r, e),
                e,
                "decisions are not stored inside shard_map yet: make the decision "
                "outside the shard_map",
            )
        return [e], [], [], list(e.outvars), r.tout


def _maker(r: _Result, outer: Any) -> Any:
    """The equation of ``r`` that makes its first stored value (or ``outer``)."""
    first = r.extra[0]
    return next((q for q in r.eqns if any(v is first for v in q.outvars)), outer)


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
