"""Decisions inside nested calls: a ``scan``, ``remat``/checkpoint or
``cond`` whose body decides is split into a *deciding* call, which returns the
decisions (stacked per step for a scan), and a *replaying* call, which takes
them as inputs in place of the equations that made them; the forward pass
runs one *fused* call returning both. A ``custom_ivjp`` function is split so
too, its replaying call still solved by the user's inverse
(:mod:`revnet._engine.decisions.ivjp_replay`). A ``while`` loop or ``shard_map`` whose
body decides on rebuilt values is refused in one line.

:class:`NestedCalls` is the decision pass's collaborator
(:class:`revnet._engine.decisions.rewrite.Pass` holds one): it runs a new
pass over each body and records which deciding call the forward pass runs
fused, and which replaying call it does without.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from revnet._engine import jaxpr as jx
from revnet._engine.decisions.ivjp_replay import Replayed
from revnet._engine.errors import cannot_store


def _refuse(what: str, r: Any, outer: Any, fix: str) -> ValueError:
    """The refusal of the first value the pass result ``r`` stores, inside
    ``what`` (the equation ``outer``), naming its equation and source line."""
    inner = _maker(r, outer)
    where = jx.where(inner) or jx.where(outer)
    label = f"`{jx.primitive_name(inner)}`"
    return cannot_store(r.kept[0].reason, label, where, f"inside {what}", fix)


# Why a lax.while_loop cannot store what its body or condition decides, and
# what can: revnet.while_loop rebuilds its own carry (so it is called outside
# the @invertible function) and records its trip count.
_NO_ROOM = "a lax.while_loop cannot store one per step"
_WHILE_BODY = (
    f"{_NO_ROOM}: use lax.fori_loop with static bounds or lax.scan, whose "
    "decisions are stored per step, or, for a data-dependent stop, "
    "revnet.while_loop with max_steps (it stores them per step) outside the "
    "@invertible function"
)
_WHILE_COND = (
    f"{_NO_ROOM}: use lax.fori_loop with static bounds or lax.scan, or, for a "
    "data-dependent stop, revnet.while_loop (it records its trip count) outside "
    "the @invertible function"
)


def body_tin(e: Any, tin: Sequence[bool]) -> list[bool]:
    """Which inputs of call ``e``'s body are rebuilt: its constants are not."""
    return [False] * len(jx.call_body(e).consts) + list(tin)


class NestedCalls:
    """The handlers of nested calls, for one decision pass.

    Args:
      sub: Makes a pass with the same options, for a body.
    """

    def __init__(self, sub: Callable[[], Any]):
        self.sub = sub
        # A deciding call (by id) -> the call returning its results too, and
        # the ids of the replaying calls the forward pass does without.
        self.fusions: dict[int, Any] = {}
        self.replays: set[int] = set()

    def fused(self, eqns: Sequence[Any]) -> list:
        """``eqns`` as the forward pass runs them: each deciding call fused
        with its replaying call."""
        return [self.fusions.get(id(e), e) for e in eqns if id(e) not in self.replays]

    def _nested(self, body: Any, rebuilt: list[bool]):
        """``(result, deciding body, replaying body)`` of a nested jaxpr."""
        r = self.sub().run(body, rebuilt)
        if not r.extra:
            return r, None, None
        deciding = jx.with_outputs(body, [*r.outvars, *r.extra], r.fused)
        live = jx.live_equations(r.eqns, r.outvars, r.extra)
        replaying = jx.with_inputs(body, [*body.invars, *r.extra], live, r.outvars)
        return r, deciding, replaying

    def _pair(self, decide, replay, fused) -> list:
        """The deciding and replaying calls; ``fused`` stands for both in the
        forward pass."""
        self.fusions[id(decide)] = fused
        self.replays.add(id(replay))
        return [decide, replay]

    def scan(self, e, tin):
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
        fused = jx.scan_with_body(e, deciding, nb, [*e.outvars, *stacked])
        why = [dataclasses.replace(k, within=("scan", *k.within)) for k in r.kept]
        return self._pair(decide, replay, fused), stacked, why, list(e.outvars), tout

    def remat(self, e, tin):
        body = jx.call_body(e)
        r, deciding, replaying = self._nested(body.jaxpr, body_tin(e, tin))
        if deciding is None:  # (with constants and decisions it was inlined)
            return [e], [], [], list(e.outvars), r.tout
        outs = [jx.new_var(jx.aval(v)) for v in r.extra]
        unused = [jx.new_var(jx.aval(v)) for v in e.outvars]
        decide = jx.remat_with_body(e, deciding, [*unused, *outs])
        replay = jx.remat_with_body(e, replaying, e.outvars, more_ins=outs)
        fused = jx.remat_with_body(e, deciding, [*e.outvars, *outs])
        why = [dataclasses.replace(k, within=("checkpoint", *k.within)) for k in r.kept]
        return self._pair(decide, replay, fused), outs, why, list(e.outvars), r.tout

    def custom_ivjp(self, e, tin):
        """A ``custom_ivjp`` function: a unit whose inverse and log-determinant
        are the user's, never evaluated at stored copies of its inputs (that
        would store the stream and hide the inverse). With a fused
        ``defivjp`` rule its cotangents are the user's too, and it is kept.
        Otherwise its cotangents come from its body at the rebuilt inputs, so
        a decision there is stored: the call is split into a deciding ``jit``
        of its body and a replaying call, still solved by the user's inverse
        (:class:`~revnet._engine.decisions.ivjp_replay.Replayed`)."""
        n = len(e.outvars)
        keep = [e], [], [], list(e.outvars), [True] * n
        fn = jx.tag_of(e)
        match = jx.custom_ivjp_match(e, fn.trees)
        if fn.user_vjp or match is None:
            return keep  # (without a match, the analysis refuses it)
        body = jx.call_body(e)
        r, deciding, replaying = self._nested(body.jaxpr, body_tin(e, tin))
        if deciding is None:
            return keep
        nh, record = match
        deciding = jx.Body(deciding, body.consts)
        (decide,), outs = jx.splice(
            jax.jit(lambda *a: jx.eval_body(deciding, *a)), e.invars, e.source_info
        )
        stored = list(outs[n:])
        fused = decide.replace(outvars=[*e.outvars, *stored])
        extras, own = [*e.invars[:nh], *stored], e.invars[nh:]
        tag = Replayed(
            fn,
            deciding,
            jx.Body(replaying, body.consts),
            [jx.aval(a) for a in extras],
            nh,
            [jx.aval(a) for a in own],
            record,
        )
        (replay,), _ = jx.splice(tag.call, [*extras, *own], e.source_info)
        replay = replay.replace(outvars=list(e.outvars))
        why = [
            dataclasses.replace(k, within=("custom_ivjp", *k.within)) for k in r.kept
        ]
        return self._pair(decide, replay, fused), stored, why, list(e.outvars), keep[4]

    def cond(self, e, tin):
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
                (jx.with_outputs(body, [*r.outvars, *outs], [*r.fused, *zeros]), nb)
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
        fused = jx.cond_with_branches(e, deciding, e.invars, [*e.outvars, *slots])
        why = [
            dataclasses.replace(k, within=("cond", *k.within))
            for r, _, _ in done
            for k in r.kept
        ]
        return self._pair(decide, replay, fused), slots, why, list(e.outvars), tout

    def while_loop(self, e, tin):
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
        for res, what, fix in (
            (r, "a while_loop body", _WHILE_BODY),
            (rc, "a while_loop condition", _WHILE_COND),
        ):
            if res.extra:
                raise _refuse(what, res, e, fix)
        return [e], [], [], list(e.outvars), carry

    def shard_map(self, e, tin):
        """A ``shard_map`` is kept; a decision in its body is refused in one line.

        Its per-device decisions would need outputs of their own specs; until
        then, a decision reading rebuilt values there must not be recomputed
        silently.
        """
        body = jx.shard_map_params(e).body
        r = jx.within_shard_map(
            e, lambda: self.sub().run(body.jaxpr, [False] * len(body.consts) + tin)
        )
        if r.extra:
            raise _refuse(
                "a shard_map body",
                r,
                e,
                "decisions are not stored inside shard_map yet: make the decision "
                "outside the shard_map",
            )
        return [e], [], [], list(e.outvars), r.tout


def _maker(r: Any, outer: Any) -> Any:
    """The equation of ``r`` that makes its first stored value (or ``outer``)."""
    first = r.extra[0]
    return next((q for q in r.eqns if any(v is first for v in q.outvars)), outer)
