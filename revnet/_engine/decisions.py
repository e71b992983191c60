"""Decisions: piecewise-constant results that the forward pass stores.

The backward pass evaluates a function's equations again on *rebuilt* values,
which differ from the forward values by rounding. Most equations do not care:
their results move by as little as their inputs. A **decision** does: its
value jumps, so near a tie (``b > 0`` with ``b`` about zero, equal logits in an
``argmax``, a half-integer under ``round``) the rebuilt input can land on the
other side, the gradient then follows the branch the forward pass did not take,
and the rebuilt inputs themselves are wrong from there on.

:func:`expose` rewrites a jaxpr so that every decision reading a rebuilt value
becomes an extra output. The forward pass computes those outputs and saves
them (in their own small dtype: bool, int8, int32), and the analysis treats
them as known, so the backward pass uses the stored decision and never makes
it again. Decisions are:

* equations with a floating-point input that is rebuilt and a result that is
  piecewise constant: a boolean or integer result (comparisons, ``is_finite``,
  ``argmax``/``argmin``, casts to integers) or ``sign``, ``round``, ``floor``,
  ``ceil``;
* ``top_k``: its indices are stored and its values gathered with them;
* ``sort``: its permutation is stored and every operand gathered with it.

A decision that reads only values the backward pass knows exactly (weights,
constants, counters, other stored decisions, integer values computed from
them) is recomputed: it cannot flip. Decisions inside a ``scan`` body are
stored for every step (extra ``ys``), inside ``remat`` and ``jit`` bodies as
extra outputs. Decisions inside a ``jax.custom_jvp``/``jax.custom_vjp``
function follow that function's own rule and are recomputed; so are decisions
inside ``cond`` branches and ``while`` loops.

**Kinks** (``max``, ``min``, ``abs``, ``jax.nn.relu``) are continuous in value:
only their derivative jumps, and only at an exact tie. They are recomputed by
default, since a stored mask per layer costs memory. With ``kinks="store"``
their derivative's branch is stored too (int8 or bool) and the backward pass
differentiates with it, exactly as ``jax.grad`` does at the forward values.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from revnet._engine import jaxpr as jx
from revnet._engine.cotangents import is_float_aval

DECISIONS = ("store", "recompute")
KINKS = ("recompute", "store")

# Float results that are piecewise constant in a float input.
_STEPS = frozenset({"sign", "round", "floor", "ceil"})
# Calls whose body may hold decisions that can be stored as extra outputs.
_REMAT = frozenset({"remat", "remat2", "checkpoint"})


@dataclasses.dataclass(frozen=True)
class Exposed:
    """A jaxpr whose stored decisions are extra outputs.

    Attributes:
      jaxpr: the rewritten jaxpr: the original outputs, then ``n`` decisions.
      n: how many decision outputs were appended (0: ``jaxpr`` is the input).
    """

    jaxpr: Any
    n: int


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
) -> Exposed:
    """Appends the decisions that read rebuilt values to ``jaxpr``'s outputs.

    Args:
      jaxpr: an open jaxpr (constants as leading inputs).
      rebuilt: for each input, whether the backward pass rebuilds it (the
        function's arguments, a loop's carry) rather than knowing it exactly.
      decisions: ``"store"``, or ``"recompute"`` to leave ``jaxpr`` as it is.
      kinks: ``"store"`` to store the branch of ``max``/``min``/``abs``/relu.

    Returns:
      The rewritten jaxpr and the number of appended outputs; with none, the
      very same jaxpr.
    """
    if decisions == "recompute":
        return Exposed(jaxpr, 0)
    new, extra, _ = _Pass(kinks == "store").run(jaxpr, list(rebuilt))
    if not extra:
        return Exposed(jaxpr, 0)
    return Exposed(jx.with_outputs(new, [*new.outvars, *extra]), len(extra))


def stored_bytes(exposed: Exposed) -> int:
    """Bytes of the decisions a call of an exposed jaxpr stores."""
    outs = exposed.jaxpr.outvars[len(exposed.jaxpr.outvars) - exposed.n :]
    return sum(
        int(np.prod(jx.aval(v).shape, dtype=np.int64))
        * np.dtype(jx.aval(v).dtype).itemsize
        for v in outs
    )


class _Pass:
    """One rewrite: tracks which variables are rebuilt, collects decisions.

    Equations are rewritten one by one; an equation replaced by others (a
    ``top_k`` split into its stored indices and a gather, an inlined call)
    maps its outputs to theirs by substitution.
    """

    def __init__(self, kinks: bool):
        self.kinks = kinks

    def run(self, jaxpr: Any, rebuilt: Sequence[bool], dry: bool = False):
        """``(new jaxpr, extra outputs, rebuilt outputs)``; ``dry``: taint only."""
        taint = dict(zip(jaxpr.invars, rebuilt))
        sub: dict = {}
        eqns: list = []
        extra: list = []

        def atom(a):
            return a if jx.is_literal(a) else sub.get(a, a)

        def tainted(a):
            return not jx.is_literal(a) and taint.get(a, False)

        work = collections.deque(jaxpr.eqns)
        while work:
            e = work.popleft()
            e = e.replace(invars=[atom(a) for a in e.invars])
            tin = [tainted(a) for a in e.invars]
            if not any(tin):
                eqns.append(e)
                continue
            if self._inlinable(e, tin) and not dry:
                inner, outs = jx.inline_body(jx.call_body(e), e.invars, e.source_info)
                for v, o in zip(e.outvars, outs):
                    if not jx.is_dropvar(v):
                        sub[v] = atom(o)
                work.extendleft(reversed(inner))
                continue
            new, stored, outs, tout = self._eqn(e, tin, dry)
            eqns.extend(new)
            extra.extend(stored)
            for ne in new:  # spliced variables are rebuilt unless stored
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
        outvars = [atom(a) for a in jaxpr.outvars]
        tout = [tainted(a) for a in outvars]
        if dry or not extra:
            return jaxpr, extra, tout
        return jx.with_outputs(jaxpr, outvars, eqns), extra, tout

    def _inlinable(self, e: Any, tin: list[bool]) -> bool:
        """Whether ``e`` is a call to inline because its body stores decisions.

        revnet's own ``scan`` (its primal body) and ``jit``s with constants are
        inlined, and so is a ``remat`` with constants; any other ``remat``
        keeps its body and gains outputs instead.
        """
        name = jx.primitive_name(e)
        tag = jx.tag_of(e)
        ours = tag is not None and getattr(tag, "loop_kind", None) == "scan"
        body = jx.call_body(e)
        if body is None:
            return False
        remat_with_consts = name in _REMAT and body.consts
        if not ours and name not in jx.JIT_NAMES and not remat_with_consts:
            return False
        nb = len(body.consts)
        _, extra, _ = _Pass(self.kinks).run(body.jaxpr, [False] * nb + tin)
        return bool(extra)

    # -- one equation --------------------------------------------------------- #

    def _eqn(self, e: Any, tin: list[bool], dry: bool):
        """``(equations replacing e, stored variables, atoms of e's outputs,
        whether each output is rebuilt)``."""
        name = jx.primitive_name(e)
        same = list(e.outvars)
        rebuilt = [True] * len(same)
        if name == "scan":
            return self._scan(e, tin, dry)
        if name in _REMAT:
            return self._remat(e, tin, dry)
        if jx.shard_map_params(e) is not None:
            return self._shard_map(e, tin)
        float_in = any(t and is_float_aval(jx.aval(a)) for t, a in zip(tin, e.invars))
        if not float_in or jx.call_body(e) is not None and name != "custom_jvp_call":
            return [e], [], same, rebuilt
        if name == "top_k":
            return self._split(e, *_top_k(e))
        if name == "sort":
            return self._split(e, *_sort(e))
        if self.kinks and name in ("max", "min", "abs"):
            return self._split(e, *_kink(e, name))
        if self.kinks and _is_relu(e):
            return self._split(e, *_kink(e, "relu"))
        if jx.call_body(e) is not None:  # a custom_jvp function: its own rule
            return [e], [], same, rebuilt
        if name == "sign" and jnp.issubdtype(jx.aval(e.outvars[0]).dtype, jnp.floating):
            return self._split(e, *_sign(e))
        outs = [v for v in e.outvars if not jx.is_dropvar(v)]
        if outs and (
            name in _STEPS or not any(is_float_aval(jx.aval(v)) for v in outs)
        ):
            return [e], outs, same, [False] * len(same)
        return [e], [], same, rebuilt

    def _split(self, e, decide, values, own):
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
        return eqns + more, [d], outs[: len(e.outvars)], rebuilt[: len(e.outvars)]

    # -- nested jaxprs -------------------------------------------------------- #

    def _scan(self, e, tin, dry):
        sp = jx.scan_params(e)
        nb, nc, ncar = len(sp.body.consts), sp.num_consts, sp.num_carry
        body = sp.body.jaxpr
        carry = list(tin[nc : nc + ncar])
        while True:  # the carry's taint, to a fixed point
            rebuilt = [False] * nb + tin[:nc] + carry + tin[nc + ncar :]
            _, _, tout = self.run(body, rebuilt, dry=True)
            new = [c or t for c, t in zip(carry, tout[:ncar])]
            if new == carry:
                break
            carry = new
        rebuilt = [False] * nb + tin[:nc] + carry + tin[nc + ncar :]
        new_body, extra, tout = self.run(body, rebuilt, dry=dry)
        tout = [*carry, *tout[ncar:]]
        if dry or not extra:
            return [e], [], list(e.outvars), tout
        stacked = [jx.new_var(jx.stacked(jx.aval(v), sp.length)) for v in extra]
        body2 = jx.with_outputs(new_body, [*new_body.outvars, *extra])
        eqn = jx.scan_with_body(e, body2, nb, [*e.outvars, *stacked])
        return [eqn], stacked, list(e.outvars), tout

    def _shard_map(self, e, tin):
        """A ``shard_map`` is kept; a decision in its body is refused in one line.

        Its per-device decisions would need outputs of their own specs; until
        then, a decision reading rebuilt values there must not be recomputed
        silently.
        """
        body = jx.shard_map_params(e).body
        nb = len(body.consts)
        _, extra, tout = self.run(body.jaxpr, [False] * nb + tin)
        if extra:
            inner = next(
                (q for q in body.jaxpr.eqns if any(v in extra for v in q.outvars)),
                e,
            )
            where = jx.where(inner) or jx.where(e)
            at = f" at {where}" if where else ""
            raise ValueError(
                f"a decision (`{jx.primitive_name(inner)}`{at}) inside a shard_map "
                "body reads values the backward pass rebuilds, and decisions are "
                "not stored inside shard_map yet; make the decision outside the "
                "shard_map, or pass decisions='recompute' (a recomputed decision "
                "may flip near a tie)"
            )
        return [e], [], list(e.outvars), tout

    def _remat(self, e, tin, dry):
        body = jx.call_body(e)
        nb = len(body.consts)
        new_body, extra, tout = self.run(body.jaxpr, [False] * nb + tin, dry=dry)
        if dry or not extra:  # (with constants and decisions it was inlined)
            return [e], [], list(e.outvars), tout
        outs = [jx.new_var(jx.aval(v)) for v in extra]
        body2 = jx.with_outputs(new_body, [*new_body.outvars, *extra])
        eqn = jx.remat_with_body(e, body2, [*e.outvars, *outs])
        return [eqn], outs, list(e.outvars), tout


# -- what each decision stores, and how its values are computed from it ------- #


def _top_k(e):
    axis = e.params.get("axis", -1)
    k = e.params["k"]

    def decide(x):
        return [jnp.moveaxis(lax.top_k(jnp.moveaxis(x, axis, -1), k)[1], -1, axis)]

    def values(x, idx):
        return [jnp.take_along_axis(x, idx, axis=axis)]

    return decide, values, 1


def _sort(e):
    dim, nk = e.params["dimension"], e.params["num_keys"]
    stable = e.params["is_stable"]

    def decide(*ops):
        iota = lax.broadcasted_iota(jnp.int32, ops[0].shape, dim)
        keys = (*ops[:nk], iota)
        return [lax.sort(keys, dimension=dim, is_stable=stable, num_keys=nk)[-1]]

    def values(*args):
        *xs, perm = args
        return [jnp.take_along_axis(x, perm, axis=dim) for x in xs]

    return decide, values, None


def _sign(e):
    """``sign`` stored as int8, converted back to its float dtype."""
    dtype = jx.aval(e.outvars[0]).dtype
    return (
        lambda x: [jnp.sign(x).astype(jnp.int8)],
        lambda x, d: [d.astype(dtype)],
        None,
    )


def _is_relu(e) -> bool:
    """Whether ``e`` is ``jax.nn.relu`` (a ``custom_jvp`` of one input)."""
    return (
        jx.primitive_name(e) == "custom_jvp_call"
        and jx.call_name(e) == "relu"
        and len(e.invars) == 1
        and len(e.outvars) == 1
    )


def _kink(e, name):
    if name == "relu":
        return (
            lambda x: [x > 0],
            lambda x, d: [jnp.where(d, x, jnp.zeros_like(x))],
            None,
        )
    if name == "abs":
        return lambda x: [x >= 0], lambda x, d: [jnp.where(d, x, -x)], None
    first = name == "max"

    def decide(a, b):
        a, b = jnp.broadcast_arrays(a, b)
        return [(a > b).astype(jnp.int8) - (a < b).astype(jnp.int8) + 1]

    def values(a, b, d):
        # max: a where a > b, b where a < b, half of each at a tie (as jax.grad
        # differentiates max); min the other way round.
        a, b = jnp.broadcast_arrays(a, b)
        hi, lo = (a, b) if first else (b, a)
        half = a * 0.5 + b * 0.5
        return [lax.select_n(d.astype(jnp.int32), lo, half, hi)]

    return decide, values, None
