"""Which values a differentiation perturbs: the symbolic zeros of revnet's VJPs.

JAX differentiates only what the differentiated inputs reach: a value that
depends on no perturbed input (an argument not in ``argnums``, a leaf under
``stop_gradient``, an integer) has a *symbolic zero* tangent, and a function
with a "must not be differentiated" guard (a ``custom_jvp`` whose rule raises
on a tangent that is not a symbolic zero, as Equinox's ``nondifferentiable``)
is accepted there. revnet's custom VJPs are defined with
``symbolic_zeros=True``: their forward pass learns which inputs are perturbed,
and their backward pass differentiates an equation only in its perturbed
inputs (:func:`active_vars`), and a loop's carry only in the leaves that a
perturbed value reaches in some step (:func:`loop_carry`).

The flags are static: they travel from a forward to its backward pass in the
residuals' structure (:class:`Flags`), never on a shared object.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from revnet._engine import jaxpr as jx
from revnet._engine.cotangents import is_float_aval


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Flags:
    """Static per-leaf flags carried in a custom VJP's residuals (no leaves)."""

    value: tuple[bool, ...]


def split_primals(tree: Any) -> tuple[Any, list[bool]]:
    """``(values, perturbed flag per leaf)`` of a ``symbolic_zeros`` fwd input."""
    is_primal = lambda x: isinstance(x, CustomVJPPrimal)  # noqa: E731
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_primal)
    values = [x.value if is_primal(x) else x for x in leaves]
    flags = [bool(x.perturbed) if is_primal(x) else True for x in leaves]
    return jax.tree_util.tree_unflatten(treedef, values), flags


def drop_symbolic_zeros(cts: Any) -> Any:
    """``None`` in place of the symbolic zero cotangents a bwd rule is given."""
    return jax.tree_util.tree_map(
        lambda c: None if isinstance(c, SymbolicZero) else c,
        cts,
        is_leaf=lambda c: isinstance(c, SymbolicZero) or c is None,
    )


def _float(v: Any) -> bool:
    return not jx.is_literal(v) and is_float_aval(jx.aval(v))


def outputs(jaxpr: Any, perturbed_in: Sequence[bool]) -> list[bool]:
    """Which outputs of ``jaxpr`` a perturbation of the inputs reaches."""
    active = active_vars(jaxpr, perturbed_in)
    return [not jx.is_literal(v) and v in active and _float(v) for v in jaxpr.outvars]


def active_vars(jaxpr: Any, perturbed_in: Sequence[bool]) -> set:
    """The variables of ``jaxpr`` that a perturbation of the inputs reaches."""
    active = {v for v, p in zip(jaxpr.invars, perturbed_in) if p and _float(v)}
    for e in jaxpr.eqns:
        ins = [not jx.is_literal(v) and v in active for v in e.invars]
        if not any(ins) or jx.has_zero_derivative(e):
            continue
        outs = _eqn_outputs(e, ins)
        active.update(v for v, o in zip(e.outvars, outs) if o and not jx.is_dropvar(v))
    return active


def _eqn_outputs(e: Any, ins: list[bool]) -> list[bool]:
    sp = jx.scan_params(e)
    if sp is not None:
        nb, nc, ncar = len(sp.body.consts), sp.num_consts, sp.num_carry
        carry = loop_carry(
            sp.body.jaxpr,
            [False] * nb + ins[:nc],
            ins[nc : nc + ncar],
            ins[nc + ncar :],
        )
        body_in = [False] * nb + ins[:nc] + carry + ins[nc + ncar :]
        outs = outputs(sp.body.jaxpr, body_in)
        return carry + outs[ncar:]
    body = jx.call_body(e)
    # A custom derivative rule decides what a perturbation reaches, not the
    # body's own derivative (a straight-through sign's body is `sign`).
    if body is not None and jx.custom_rule_kind(e) is None:
        return outputs(body.jaxpr, [False] * len(body.consts) + ins)
    return [_float(v) for v in e.outvars]


def loop_carry(
    body: Any, consts: Sequence[bool], carry: Sequence[bool], xs: Sequence[bool]
) -> list[bool]:
    """The carry leaves a perturbation reaches in some step of a loop, whose
    ``body`` maps ``(consts, carry, xs)`` to the carry (then anything)."""
    carry = list(carry)
    while True:
        outs = outputs(body, [*consts, *carry, *xs])[: len(carry)]
        new = [c or o for c, o in zip(carry, outs)]
        if new == carry:
            return carry
        carry = new
