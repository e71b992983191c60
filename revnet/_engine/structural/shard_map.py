"""The structural rule for ``shard_map``: its per-device body, inverted per device.

A ``shard_map`` equation keeps its body in its params. Each device runs the
body on its own blocks, so the body is inverted like a nested call's: its plan
rebuilds the unknown inputs' blocks from the outputs' blocks and the known
inputs' blocks, on every device. Collectives in the body (``psum`` over known
values, ``ppermute``, ``all_gather``, ``all_to_all`` on the stream) are
evaluated forward or solved by their rules in ``revnet.rules``.

The body's plan is made inside the body's context (its manual mesh axes
bound, :func:`~revnet._engine.jaxpr.within_shard_map`), where its rules can
trace. At run time a new ``shard_map`` of the same mesh runs the plan per
device: it takes the known inputs with their ``in_specs`` and the outputs (and
their cotangents) with their ``out_specs``, and returns the rebuilt inputs and
the input cotangents with the inputs' ``in_specs``: each of its primal's type.

Its log-determinant (:class:`_ShardMapTerms`) is the sum of the devices'
terms with each distinct block counted once, computed by a second
``shard_map`` of the same mesh that returns it (the equation itself is left as
it is, so that a program with its log-determinant inverts as the program
does).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from revnet._engine import analysis, log_det, registry, runtime_checks, sharded_types
from revnet._engine import cotangents as ct
from revnet._engine import jaxpr as jx
from revnet._engine.batching.axes import spec_entries
from revnet._engine.errors import Stuck
from revnet._engine.interpreter import Handler, apply_eqn, register_handler, run_plan
from revnet._engine.plan import Plan


@dataclasses.dataclass(frozen=True)
class ShardMap:
    """A ``shard_map`` whose body's ``plan`` rebuilds its ``unknown`` inputs."""

    eqn: int
    unknown: tuple[int, ...]
    plan: Plan


class ShardMapRule(registry.StructuralRule):
    name = "shard_map"

    def analyze(self, an, i, eqn, ins, outs):
        if not any(outs) or not an.distinct_unknowns(i, eqn, ins):
            return None
        sm = jx.shard_map_params(eqn)
        known_in = (True,) * len(sm.body.consts) + tuple(ins)
        try:
            plan = jx.within_shard_map(
                eqn, lambda: analysis.analyze(sm.body.jaxpr, known_in, tuple(outs))
            )
        except Stuck as stuck:
            an.fail(i, eqn, "its per-device body is not invertible", stuck.failure)
            return None
        unknown = tuple(n for n, k in enumerate(ins) if not k)
        step = ShardMap(i, unknown, plan)
        return step, [an.wiring.eqn_ins[i][n] for n in unknown], (i,)


class _ShardMapHandler(Handler):
    fuses = True

    def known_outs(self, it, step):
        return list(step.plan.known_out)

    def run(self, it, step, out_cts):
        i = step.eqn
        eqn = it.jaxpr.eqns[i]
        sm = jx.shard_map_params(eqn)
        body, nb = sm.body, len(sm.body.consts)
        in_avals = [jx.aval(v) for v in body.jaxpr.invars[nb:]]
        out_avals = [jx.aval(v) for v in body.jaxpr.outvars]
        unknown = set(step.unknown)
        known_idx = [n for n in range(len(eqn.invars)) if n not in unknown]
        out_idx = [n for n, k in enumerate(step.plan.known_out) if k]
        known = [it.read_in(i, n) for n in known_idx]
        outs = [it.read(it.wiring.eqn_outs[i][n]) for n in out_idx]
        perturbed = it.perturbed(i)
        # Cotangents flow to the float inputs only (a shard_map returns arrays).
        float_in = [n for n, a in enumerate(in_avals) if ct.is_float_aval(a)]
        with_cts = out_cts is not None
        cts = list(out_cts) if with_cts else []
        nk, no = len(known), len(outs)

        def per_device(*args):
            given = [
                sharded_types.cast_like(x, in_avals[n])
                for x, n in zip(args[:nk], known_idx)
            ]
            ys = [
                sharded_types.cast_like(y, out_avals[n])
                for y, n in zip(args[nk : nk + no], out_idx)
            ]
            body_cts = None
            if with_cts:
                body_cts = [
                    sharded_types.cast_like(c, a)
                    for c, a in zip(args[nk + no :], out_avals)
                ]
                if not sm.check_vma:  # as JAX's transpose of shard_map
                    body_cts = [
                        _per_copy(c, _unmentioned(sm, s))
                        for c, s in zip(body_cts, sm.out_specs)
                    ]
            with runtime_checks.scope() as sc:
                vals, in_cts = run_plan(
                    step.plan,
                    body.jaxpr,
                    [*body.consts, *given],
                    ys,
                    body_cts,
                    None if perturbed is None else [False] * nb + list(perturbed),
                )
            # The run-time checks' records are per device: their failure index
            # leaves the shard_map as one entry per device.
            failed = ()
            if sc is not None:
                index, messages[:] = sc.reduce()
                failed = (index.reshape((1,)),)
            rebuilt = [
                sharded_types.cast_like(v, in_avals[n])
                for v, n in zip(vals, step.unknown)
            ]
            if not with_cts:
                return (*failed, *rebuilt)
            in_cts = ct.fill(in_cts[nb:], in_avals)
            if not sm.check_vma:  # as JAX's transpose of shard_map
                in_cts = [
                    _summed(c, _unmentioned(sm, s)) for c, s in zip(in_cts, sm.in_specs)
                ]
            return (*failed, *rebuilt, *[in_cts[n] for n in float_in])

        in_specs = [sm.in_specs[n] for n in known_idx]
        in_specs += [sm.out_specs[n] for n in out_idx]
        out_specs = [sm.in_specs[n] for n in step.unknown]
        if with_cts:
            in_specs += list(sm.out_specs)
            out_specs += [sm.in_specs[n] for n in float_in]
        messages: list[str] = []
        checking = runtime_checks.enabled()
        if checking:
            out_specs = [P(_manual(sm)), *out_specs]
        res = jx.shard_map(sm, per_device, in_specs, out_specs)(*known, *outs, *cts)
        res = list(res)
        if checking:
            runtime_checks.record_index(jnp.max(res.pop(0)), messages)
        it.set([it.wiring.eqn_ins[i][n] for n in step.unknown], res[: len(unknown)])
        if not with_cts:
            return None
        in_cts = [None] * len(eqn.invars)
        for n, c in zip(float_in, res[len(unknown) :]):
            in_cts[n] = c
        return in_cts


def _manual(sm) -> tuple:
    """The body's manual mesh axes, in the mesh's order."""
    return tuple(a for a in sm.mesh.axis_names if a in sm.axis_names)


def _unmentioned(sm, spec) -> tuple:
    """The manual mesh axes a spec does not name: the value is replicated there."""
    named = set()
    for entry in tuple(spec or ()):
        if entry is None:
            continue
        named |= set(entry) if isinstance(entry, tuple) else {entry}
    return tuple(a for a in sm.mesh.axis_names if a in sm.axis_names and a not in named)


def _per_copy(c, axes: tuple):
    """Without ``check_vma`` JAX splits a replicated output's cotangent evenly
    between its copies."""
    if not axes or not ct.is_float(c):
        return c
    return c / jax.lax.axis_size(axes)


def _summed(c, axes: tuple):
    """... and sums a replicated input's cotangent over its copies."""
    if not axes or not ct.is_float(c):
        return c
    return jax.lax.psum(c, axes)


class _ShardMapTerms(log_det.TermRule):
    """A ``shard_map`` adds its devices' terms, each distinct value once.

    The global map's variables are the distinct blocks: a value whose type
    varies along the manual axes ``V`` has one block per position along
    ``V``, and its copies along the other axes are the same variable. Each
    term of the body is summed (``psum``) over the axes ``V`` of the value it
    solves: once per block, whatever the term itself varies along (a factor
    replicated on every device scales every block). A per-example
    log-determinant keeps the axes that split the batch, and leaves the
    ``shard_map`` split as its batched inputs are.
    """

    evaluates = True

    def has_terms(self, step, eqn):
        return log_det.has_terms(step.plan, jx.shard_map_params(eqn).body.jaxpr)

    def evaluate(self, ev, step, eqn, ins):
        sm = jx.shard_map_params(eqn)
        if ev.share is not None:
            raise log_det.refusal(eqn, "a shard_map inside another's body")
        k = ev.zero.ndim
        batch = {spec_entries(sm.in_specs[n], k) for n in step.unknown}
        if len(batch) != 1:
            raise log_det.refusal(
                eqn,
                "a per-example log-determinant needs the batch's axes split alike "
                "in every rebuilt input, and its in_specs split them differently",
            )
        (entries,) = batch
        batch_axes = frozenset(a for e in entries for a in e)
        manual = frozenset(sm.axis_names)
        split = all(
            not _unmentioned(sm, spec)
            for spec in [*[sm.in_specs[n] for n in step.unknown], *sm.out_specs]
        )
        body, nb = sm.body, len(sm.body.consts)
        local = tuple(jx.aval(body.jaxpr.invars[nb + step.unknown[0]]).shape[:k])

        def share(term, avals, e):
            if not sm.check_vma:
                if not split:
                    raise log_det.refusal(
                        eqn,
                        "without check_vma revnet cannot tell which values are "
                        "replicated across devices (a term counted once) and "
                        "which are not; use check_vma=True, or split every "
                        "rebuilt input and every output over every manual axis "
                        f"{sorted(manual)}",
                    )
                # Every solved value is then split over every manual axis.
                return _summed(term, tuple(sorted(manual - batch_axes)))
            kinds = {sharded_types.varying(a) for a in avals}
            if len(kinds) != 1:
                raise log_det.refusal(
                    e,
                    "it solves values that vary along different mesh axes, so "
                    "their term's copies cannot be counted once",
                )
            (varying,) = kinds
            have = sharded_types.varying(jax.typeof(term))
            if have - varying:
                raise log_det.refusal(
                    e,
                    f"its term varies along the mesh axes {sorted(have - varying)} "
                    "and the value it solves does not",
                )
            if batch_axes - varying:
                raise log_det.refusal(
                    e,
                    "per example, the value it solves is replicated along the "
                    f"mesh axes {sorted(batch_axes - varying)} that split the batch",
                )
            if varying - have:  # a factor the same on every device
                term = jax.lax.pcast(term, tuple(sorted(varying - have)), to="varying")
            return _summed(term, tuple(sorted(varying - batch_axes)))

        def per_device(*args):
            zero = jnp.zeros(local, ev.zero.dtype)
            if sm.check_vma and batch_axes:
                zero = jax.lax.pcast(zero, tuple(sorted(batch_axes)), to="varying")
            _, term = ev.nested(
                step.plan, body.jaxpr, [*body.consts, *args], zero, share
            )
            return (term,)

        # The terms come from a shard_map of their own: the equation itself
        # stays as it is, so that a program with its log-determinant inverts
        # as the program does (its outputs rebuild its inputs, and then the
        # terms are evaluated forward from them).
        spec = P(*[e or None for e in entries])
        term = jx.shard_map(sm, per_device, sm.in_specs, (spec,))(*ins)[0]
        return apply_eqn(eqn, ins), ev.like_zero(term)


registry.register_structural(["shard_map"], ShardMapRule())
register_handler(ShardMap, _ShardMapHandler())
log_det.register_term_rule(ShardMap, _ShardMapTerms())
