"""Which values of a program keep the batch's axes, example by example.

A per-example log-determinant sums each solved value's terms over all but its
leading ``k`` axes, which is right only where element ``[b, ...]`` of that
value depends on example ``b`` alone. This pass proves it from the program,
forward, marking each variable

* :data:`UNBATCHED`: it reads no batched value (weights, constants);
* :data:`LEADING`: its leading ``k`` axes are the batch's, and each example's
  slice reads only that example;
* ``LEADING + d``: the same with the batch's axes after ``d`` leading axes of
  steps: the ``ys`` a ``scan`` stacks from per-example values (the decisions a
  scanned flow stores, one per step and example);
* :data:`MIXED`: anything else (a reduction over the batch axis, a reshape
  that merges it, a primitive this pass cannot read).

An equation keeps :data:`LEADING` when the axes its params name (``axes``,
``dimension``, ``permutation``, ``dimension_numbers``, ...) leave the leading
``k`` alone, or when it names no axes and maps each position of its batched
inputs to the same position of its outputs (elementwise and ``select_n``);
the rules by params are in :mod:`.batch_params`. A param this pass does not
know makes the result :data:`MIXED`: the pass can refuse a per-example
log-determinant, never give a wrong one. Nested calls,
``scan`` (the carry to a fixed point) and ``cond`` are read through their
bodies. Only a ``scan`` moves the batch's axes from the front: it stacks its
``ys`` on one more leading axis and slices its ``xs`` off one, so a
``LEADING + d`` value reaches a step's body as ``LEADING + d - 1``. A call
hands stacked values to its body; any other equation reading one (a
``shard_map`` too) is :data:`MIXED`. So every value that a step other than a
scan solves leads with the batch's axes, as the terms' reduction assumes (a
scan reduces its steps' terms in its body).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from revnet._engine import jaxpr as jx
from revnet._engine.batching.params import (
    HARMLESS,
    LEADING,
    MIXED,
    UNBATCHED,
    in_place,
    keeps_leading,
)

# Collectives that map each position to the same position on other devices.
_IN_PLACE = frozenset({"ppermute", "psum", "psum_invariant", "pmax", "pmin"})
# Collectives that move or concatenate along these dimensions.
_COLLECTIVE_DIMS = {
    "all_to_all": ("split_axis", "concat_axis"),
    "all_gather": ("all_gather_dimension",),
    "all_gather_invariant": ("all_gather_dimension",),
    "reduce_scatter": ("scatter_dimension",),
}


def spec_entries(spec: Any, k: int) -> tuple:
    """The mesh axes that split each of a ``PartitionSpec``'s first ``k``
    dimensions, a tuple of names for each."""
    padded = (*tuple(spec or ()), *(None,) * k)[:k]
    return tuple(
        () if e is None else tuple(e) if isinstance(e, (tuple, list)) else (e,)
        for e in padded
    )


def _named_axes(eqn: Any) -> frozenset:
    """The mesh axes a collective equation runs along."""
    p = eqn.params
    names = p.get("axis_name", p.get("axes", ()))
    names = names if isinstance(names, (tuple, list)) else (names,)
    return frozenset(a for a in names if isinstance(a, str))


def _collective(eqn: Any) -> bool:
    """Whether ``eqn`` communicates between devices (or changes varying axes)."""
    return (
        "axis_name" in eqn.params
        or jx.primitive_name(eqn) in _IN_PLACE | {"pvary"}
        or bool(_named_axes(eqn))
    )


def _join(flags: Sequence[int]) -> int:
    """The flag of a value that reads values flagged ``flags``: batched ones
    with their batch's axes in different places are :data:`MIXED`."""
    batched = set(flags) - {UNBATCHED}
    if not batched:
        return UNBATCHED
    return batched.pop() if len(batched) == 1 else MIXED


def _leading(shape: Sequence[int], batch: tuple) -> bool:
    return tuple(shape[: len(batch)]) == batch


def reads(jaxpr: Any, flagged: Sequence[bool]) -> list[bool]:
    """Whether each output of ``jaxpr`` is computed from an input flagged True:
    :class:`Tracker`'s :data:`UNBATCHED` with the flagged inputs batched (one
    example, ``k = 0``). Nested calls, a ``scan``'s carry (to a fixed point)
    and a ``cond``'s branches are read through; a ``while`` or a ``cond`` whose
    predicate reads a flagged input reads it in every output.
    """
    flags = [LEADING if f else UNBATCHED for f in flagged]
    return [f != UNBATCHED for f in Tracker(()).run(jaxpr, flags)[1]]


class Tracker:
    """Flags the variables of one jaxpr (by the plan's wiring ids).

    Inside a ``shard_map`` body (``manual``), the batch is the devices'
    blocks of it, split along the mesh axes ``axes``.
    """

    def __init__(self, batch: tuple, axes: frozenset = frozenset(), manual=False):
        self.batch, self.k = batch, len(batch)
        self.axes, self.manual = axes, manual

    def run(self, jaxpr: Any, in_flags: Sequence[int]) -> tuple[dict, list[int]]:
        """``(flags by variable, flags of the outputs)``."""
        flags: dict = dict(zip(jaxpr.invars, in_flags))

        def flag(a):
            return UNBATCHED if jx.is_literal(a) else flags[a]

        for eqn in jaxpr.eqns:
            outs = self.eqn(eqn, [flag(a) for a in eqn.invars])
            for v, f in zip(eqn.outvars, outs):
                if not jx.is_dropvar(v):
                    flags[v] = f
        return flags, [flag(a) for a in jaxpr.outvars]

    def first_mixing(
        self, jaxpr: Any, in_flags: Sequence[int], outputs: Iterable[int]
    ) -> tuple[Any, str | None] | None:
        """The first equation of ``jaxpr`` that mixes examples on the way to
        one of its ``outputs`` (positions), with the reason when this pass
        can say more than that it mixes them (None); None if none does."""
        flags, outs = self.run(jaxpr, in_flags)
        bad = [jaxpr.outvars[n] for n in outputs if outs[n] == MIXED]
        reach = {v for v in bad if not jx.is_literal(v)}
        if not reach:
            return None
        for eqn in reversed(jaxpr.eqns):  # the equations leading to them
            if any(v in reach for v in eqn.outvars):
                reach.update(v for v in eqn.invars if not jx.is_literal(v))
        for eqn in jaxpr.eqns:
            if not any(v in reach for v in eqn.outvars):
                continue
            ins = [UNBATCHED if jx.is_literal(v) else flags[v] for v in eqn.invars]
            if MIXED not in ins and any(flags.get(v) == MIXED for v in eqn.outvars):
                return self._why(eqn, ins)
        return None  # pragma: no cover - a MIXED output has a first cause

    def _why(self, eqn: Any, in_flags: list[int]) -> tuple[Any, str | None]:
        """The equation that mixes examples in ``eqn`` (``eqn`` itself, or one
        in its ``shard_map`` body), and why."""
        sm = jx.shard_map_params(eqn)
        if sm is not None:
            return self._shard_map_why(eqn, sm, in_flags)
        if _any_stacked(in_flags) and not _reads_through(eqn):
            return eqn, (
                "this equation reads a scan's outputs stacked over its steps, "
                "which revnet follows example by example only into another scan"
            )
        if self.manual and _collective(eqn) and _named_axes(eqn) & self.axes:
            return eqn, (
                "this collective runs along mesh axes that split the batch "
                f"({sorted(_named_axes(eqn) & self.axes)}): it moves values "
                "between devices that hold different examples"
            )
        return eqn, None

    def _shard_map_why(self, eqn, sm, in_flags) -> tuple[Any, str | None]:
        if _any_stacked(in_flags):
            return eqn, "this shard_map reads a scan's outputs stacked over its steps"
        lead = [n for n, f in enumerate(in_flags) if f == LEADING]
        split = {spec_entries(sm.in_specs[n], self.k) for n in lead}
        if len(split) != 1:
            return eqn, (
                "the in_specs of this shard_map's batched inputs split the "
                "batch's axes differently"
            )
        inner, entries = self._inside(sm, lead)
        nb = len(sm.body.consts)
        outs = inner.run(sm.body.jaxpr, [UNBATCHED] * nb + list(in_flags))[1]
        for n, (f, spec) in enumerate(zip(outs, sm.out_specs)):
            if f == LEADING and spec_entries(spec, self.k) != entries:
                return eqn, (
                    f"the out_specs of this shard_map's output {n} split the "
                    "batch's axes otherwise than its batched inputs' in_specs"
                )
            if _any_stacked([f]):
                return eqn, (
                    f"this shard_map's output {n} is a scan's, stacked over its steps"
                )
        mixed = [n for n, f in enumerate(outs) if f == MIXED]
        found = inner.first_mixing(
            sm.body.jaxpr, [UNBATCHED] * nb + list(in_flags), mixed
        )
        return (eqn, None) if found is None else found

    def _inside(self, sm: Any, lead: list[int]) -> tuple[Tracker, tuple]:
        """The tracker of ``sm``'s body, whose batched inputs are ``lead``
        (split alike), and how their specs split the batch's axes."""
        (entries,) = {spec_entries(sm.in_specs[n], self.k) for n in lead}
        nb = len(sm.body.consts)
        shape = tuple(jx.aval(sm.body.jaxpr.invars[nb + lead[0]]).shape[: self.k])
        axes = self.axes | {a for e in entries for a in e}
        return Tracker(shape, frozenset(axes), True), entries

    def eqn(self, eqn: Any, in_flags: list[int]) -> list[int]:
        n_out = len(eqn.outvars)
        joined = _join(in_flags)
        if joined == UNBATCHED or MIXED in in_flags:
            return [joined] * n_out
        # A body slices and stacks its inputs itself (a scan's ``xs`` and
        # constants need not agree): read it before joining the flags.
        nested = self._nested(eqn, in_flags)
        if nested is not None:
            return nested
        if joined != LEADING:
            return [MIXED] * n_out
        shapes_ok = all(
            _leading(jx.aval(a).shape, self.batch)
            for a, f in zip(eqn.invars, in_flags)
            if f == LEADING
        ) and all(_leading(jx.aval(v).shape, self.batch) for v in eqn.outvars)
        if not shapes_ok:
            return [MIXED] * n_out
        if self.manual and _collective(eqn):
            return [LEADING if self._keeps(eqn) else MIXED] * n_out
        keys = set(eqn.params) - HARMLESS
        if not keys:  # no axes named: position to position
            out = tuple(jx.aval(eqn.outvars[0]).shape)
            same = all(
                in_place(tuple(jx.aval(a).shape), out)
                for a, f in zip(eqn.invars, in_flags)
                if f == LEADING
            )
            return [LEADING if same else MIXED] * n_out
        return [LEADING if keeps_leading(eqn, in_flags, self.k) else MIXED] * n_out

    def _nested(self, eqn: Any, in_flags: list[int]) -> list[int] | None:
        sp = jx.scan_params(eqn)
        if sp is not None:
            return self._scan(sp, in_flags)
        branches = jx.cond_branches(eqn)
        if branches is not None:
            if in_flags[0] != UNBATCHED:
                return [MIXED] * len(eqn.outvars)
            outs = [self._body(b, in_flags[1:]) for b in branches]
            return [_join(f) for f in zip(*outs)]
        sm = jx.shard_map_params(eqn)
        if sm is not None:
            return self._shard_map(sm, in_flags)
        body = jx.call_body(eqn)
        if body is not None:
            return self._body(body, in_flags)
        if jx.primitive_name(eqn) == "while":
            return [MIXED] * len(eqn.outvars)
        return None

    def _shard_map(self, sm: Any, in_flags: list[int]) -> list[int]:
        """Per device on blocks of the batch: each example stays put when every
        batched input and output splits the batch's axes alike (its blocks are
        the same examples on every device along the other mesh axes). Values
        stacked over a scan's steps, in or out, are not read (:data:`MIXED`):
        the specs would have to be read past the steps axes."""
        lead = [n for n, f in enumerate(in_flags) if f == LEADING]
        if _any_stacked(in_flags) or (
            len({spec_entries(sm.in_specs[n], self.k) for n in lead}) != 1
        ):
            return [MIXED] * len(sm.out_specs)
        inner, entries = self._inside(sm, lead)
        outs = inner._body(sm.body, in_flags)
        return [
            MIXED
            if _any_stacked([f])
            or (f == LEADING and spec_entries(spec, self.k) != entries)
            else f
            for f, spec in zip(outs, sm.out_specs)
        ]

    def _keeps(self, eqn: Any) -> bool:
        """Whether a collective keeps each example in place: it runs along mesh
        axes that do not split the batch (so the devices it connects hold the
        same examples), and splits or concatenates no batch axis."""
        p, k = eqn.params, self.k
        if jx.primitive_name(eqn) == "pvary":  # the value unchanged
            return True
        if _named_axes(eqn) & self.axes:
            return False
        name = jx.primitive_name(eqn)
        if name in _IN_PLACE:
            return True
        dims = [p[d] for d in _COLLECTIVE_DIMS.get(name, ()) if d in p]
        return bool(dims) and all(int(d) >= k for d in dims)

    def _body(self, body: Any, in_flags: Sequence[int]) -> list[int]:
        n = len(body.consts)
        return self.run(body.jaxpr, [UNBATCHED] * n + list(in_flags))[1]

    def _scan(self, sp: Any, in_flags: list[int]) -> list[int]:
        nc, ncar = sp.num_consts, sp.num_carry
        consts, carry, xs = (
            in_flags[:nc],
            in_flags[nc : nc + ncar],
            in_flags[nc + ncar :],
        )
        xs = [_sliced(f) for f in xs]
        while True:  # the carry's flags only rise, in a lattice of height 2
            outs = self._body(sp.body, [*consts, *carry, *xs])
            new = [_join((a, b)) for a, b in zip(carry, outs[:ncar])]
            if new == carry:
                break
            carry = new
        return [*carry, *(_stacked(f) for f in outs[ncar:])]


def _reads_through(eqn: Any) -> bool:
    """Whether this pass reads ``eqn`` through its body (a scan, a cond, a
    call), where the equation that mixes examples may lie."""
    return (
        jx.scan_params(eqn) is not None
        or jx.cond_branches(eqn) is not None
        or jx.call_body(eqn) is not None
    )


def _any_stacked(flags: Sequence[int]) -> bool:
    """Whether a flag says batch axes behind a scan's axis of steps."""
    return any(f not in (UNBATCHED, LEADING, MIXED) for f in flags)


def _sliced(flag: int) -> int:
    """A scanned input's flag in the body: one axis of steps fewer. Scanning
    over the batch's own leading axis hands each step other examples."""
    if flag in (UNBATCHED, MIXED):
        return flag
    return MIXED if flag == LEADING else flag - 1


def _stacked(flag: int) -> int:
    """A body output's flag once the scan stacks it over the steps."""
    return flag if flag in (UNBATCHED, MIXED) else flag + 1
