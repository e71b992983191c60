"""What ``revnet.while_loop`` and ``revnet.scan`` share, one step each.

The front-ends in :mod:`revnet.loops` call these in order, after checking
the options (:mod:`revnet._loop_options`): the body traced once to a flat jaxpr, the
initial carry promoted as ``lax.scan`` does and the carry returned checked
(:func:`traced_body`; a while loop's condition: :func:`traced_cond`); the
decisions exposed and the backward mode chosen (:func:`backward_mode`, by the
rule of :mod:`revnet._engine.loops.choose`); then the loop the engine builds
is run by :func:`call`, which names the loop when forward mode reaches it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from revnet._engine import (
    INT32_MAX,
    Stuck,
    aval,
    boundary,
    cannot_store,
    choose,
    leaf_paths,
    lost_leaves,
    not_invertible,
    reverse_mode_only,
    row,
    struct,
    trace,
    trace_program,
    visible_damping,
)
from revnet._loop_options import SCAN, WHILE, Options

# --------------------------------------------------------------------------- #
# The traced body.


@dataclasses.dataclass(frozen=True)
class TracedBody:
    """A loop body traced once, flat: constants, carry, ``xs`` -> carry, ``ys``.

    Attributes:
      name: the body's name, for messages.
      jaxpr, program: the body as the analysis reads it, and as traced
        (:func:`revnet._engine.trace_program`).
      consts: the values it closes over, its first ``nk`` inputs.
      carry: the initial carry's ``nc`` leaves, promoted.
      init_tree, out_tree: the trees of the carry and of the body's result.
      paths: ``(prefix, init)``: names the carry's leaves in messages.
    """

    name: str
    jaxpr: Any
    program: Any
    consts: list
    carry: list
    init_tree: Any
    out_tree: Any
    paths: tuple[str, Any]

    @property
    def nk(self) -> int:
        return len(self.consts)

    @property
    def nc(self) -> int:
        return len(self.carry)

    def fail(self, stuck: Any) -> Exception:
        """The :class:`revnet.NotInvertibleError` of ``stuck``, naming the leaf."""
        carry = range(self.nk, self.nk + self.nc)
        lost = [self.nk + k for k in lost_leaves(self.jaxpr, carry, stuck.unknown)]
        paths = leaf_paths(*self.paths)
        return not_invertible(stuck, paths, self.nk, self.name, lost=lost)

    def unflatten(self, leaves: list) -> Any:
        """The loop's result from its leaves."""
        return jax.tree_util.tree_unflatten(self.out_tree, leaves)


def traced_body(
    fun: Callable[..., Any], arg: str, init: Any, init_arg: str, options: Options
) -> TracedBody:
    """The body ``fun(carry)`` (a scan's ``fun(carry, x)``) traced once.

    ``arg`` and ``init_arg`` name ``fun`` and ``init`` in messages; a scan's
    ``xs`` come with its ``options``.

    Raises:
      TypeError: when a scan's body does not return a pair, or the body
        returns a carry of another structure, shape or dtype.
    """
    name = _name(fun, arg)
    leaves, tree = jax.tree_util.tree_flatten(init)
    nc, pair = len(leaves), options.loop == SCAN
    # Each x as the body sees it, with its sharding (an Explicit one is part of
    # its type), so that the body is traced at the types it runs at.
    x_slices = [struct(row(jax.typeof(x))) for x in options.xs]
    trees: list = []

    def flat(*args):
        carry = jax.tree_util.tree_unflatten(tree, args[:nc])
        if pair:
            out = fun(carry, jax.tree_util.tree_unflatten(options.x_tree, args[nc:]))
        else:
            out = fun(carry)
        out_leaves, out_tree = jax.tree_util.tree_flatten(out)
        c_out_tree = out_tree
        if pair:  # as in lax.scan: any pytree node with two children is a pair.
            children = jax.tree_util.treedef_children(out_tree)
            if len(children) != 2:
                raise TypeError(
                    f"{name} must return a pair (carry, y), got a value of "
                    f"structure {out_tree}"
                )
            c_out_tree = children[0]
        trees.append((out_tree, c_out_tree))
        return out_leaves

    def carry_of(*args):
        return flat(*args)[: trees[-1][1].num_leaves]

    leaves = _promoted_carry(carry_of, leaves, x_slices)
    jaxpr, program, consts, _ = trace_program(flat, leaves + x_slices)
    nk = len(consts)
    out_tree, c_out_tree = trees[-1]
    if tree != c_out_tree:
        raise TypeError(
            f"{name} must return a carry with the same structure as its input: "
            f"got {c_out_tree}, expected {tree}"
        )
    in_avals = [aval(v) for v in jaxpr.invars[nk : nk + nc]]
    out_avals = [aval(v) for v in jaxpr.outvars[:nc]]
    for a, b in zip(in_avals, out_avals):
        if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
            raise TypeError(
                f"{name} must return a carry with the same shapes and dtypes as its "
                f"input: got ({_describe(out_avals)}), expected ({_describe(in_avals)})"
            )
    return TracedBody(
        name, jaxpr, program, consts, leaves, tree, out_tree, (init_arg, init)
    )


def traced_cond(cond_fun: Callable[[Any], Any], body: TracedBody) -> tuple[Any, list]:
    """``(jaxpr, consts)`` of a while loop's condition, on ``body``'s carry;
    TypeError unless it returns a boolean scalar."""

    def flat_cond(*carry):
        return cond_fun(jax.tree_util.tree_unflatten(body.init_tree, carry))

    jaxpr, consts, _ = trace(flat_cond, body.carry)
    pred = [aval(v) for v in jaxpr.outvars]
    if len(pred) != 1 or pred[0].shape != () or pred[0].dtype != jnp.bool_:
        raise TypeError(
            f"cond_fun must return a boolean scalar, got ({_describe(pred)})"
        )
    return jaxpr, consts


def _name(fun: Any, default: str) -> str:
    """A function's name for messages, looking through ``functools.partial``."""
    while not hasattr(fun, "__name__") and hasattr(fun, "func"):
        fun = fun.func
    return getattr(fun, "__name__", default)


def _inexact(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _describe(avals: Any) -> str:
    return ", ".join(f"{a.dtype}{list(a.shape)}" for a in avals)


def _promoted_carry(fun: Callable[..., Any], leaves: list, extra: list) -> list:
    """The initial carry's leaves as arrays, promoted as ``lax.scan`` does.

    ``lax.scan`` and ``lax.while_loop`` let a weakly typed leaf of the initial
    carry (a Python scalar such as ``0`` or ``1.0``) take the dtype that the
    body returns for it (``0`` becomes float32 when the body adds a float32 to
    it), and check the carry's type only after that promotion. A weak leaf
    whose dtype the body keeps stays weak (``lax.scan(f, 0, xs)`` with ``f``
    returning ``c + 1`` returns a weak int32): under
    ``jax.numpy_dtype_promotion("strict")`` the body may then add it to a
    float. This does the same, by one abstract evaluation of
    ``fun(*leaves, *extra)``, which returns the new carry's leaves, and only
    when a leaf is weak. When the body returns a carry with another number of
    leaves nothing is promoted: the carry check that follows reports it.
    """
    arrays = [jnp.asarray(x) for x in leaves]
    if any(getattr(a, "weak_type", False) for a in arrays):
        out = jax.eval_shape(fun, *arrays, *extra)
        if len(out) == len(arrays):
            arrays = [
                a
                if not getattr(a, "weak_type", False) or a.dtype == o.dtype
                else lax.convert_element_type(a, jax.dtypes.result_type(a, o))
                for a, o in zip(arrays, out)
            ]
    return arrays


# --------------------------------------------------------------------------- #
# The backward mode, and the call.


def backward_mode(body: TracedBody, options: Options) -> tuple[Any, Any, tuple]:
    """``(jaxpr, mode, decided)``: the body the loop runs, its backward mode,
    and the records (:class:`revnet._engine.Kept`) of the decisions (and, with
    ``kinks="store"``, kinks) it returns after its carry, stored per step unless
    checkpointed: among a scan's ``ys``, or in ``max_steps`` rows of a while
    loop's buffers. Without ``max_steps`` a while loop has no such room: its
    body is checkpointed, and ``mode="invert"`` raises one ValueError."""
    o, carry, rebuilt = options, range(body.nk, body.nk + body.nc), [False] * body.nk
    # Integer leaves (a step counter) are rebuilt exactly: a decision read from
    # them alone is recomputed, never stored.
    rebuilt += [_inexact(c) for c in body.carry] + [False] * len(o.xs)
    if o.bound is not None:  # a scan, or a while loop with max_steps
        exposed, mode = choose.exposed_mode(
            body.jaxpr, rebuilt, carry, o.mode, body.fail, o.storage
        )
        extra = 0 if mode.kind == choose.CHECKPOINT else exposed.n
        return (exposed.jaxpr if extra else body.jaxpr), mode, exposed.kept[:extra]
    mode = o.mode
    exposed = o.storage.expose(body.jaxpr, rebuilt)
    if exposed.n:
        if mode == choose.INVERT:
            k = exposed.kept[0]
            raise cannot_store(
                *(k.reason, k.label, k.where, f"in body_fun `{body.name}`"),
                "without max_steps a while loop has no room to store one per step "
                "for mode='invert': give max_steps (room for that many steps), or "
                "use mode='checkpoint' (checkpointing recomputes it exactly)",
                WHILE,
            )
        mode = choose.CHECKPOINT
    known_in = tuple(n not in carry for n in range(len(body.jaxpr.invars)))
    try:
        chosen = choose.choose_mode(body.jaxpr, known_in, carry, False, mode)
    except Stuck as stuck:
        raise body.fail(stuck) from None
    return body.jaxpr, chosen, ()


def armed(options: Options, body: TracedBody, jaxpr: Any, mode: Any) -> Options:
    """``options``, with the boundary check armed for this loop (a warning)
    when ``mode="auto"`` chose to invert a body that divides by a factor of
    modulus below 1 known at trace time while the check is off."""
    if (
        options.mode != choose.AUTO
        or mode.kind != choose.INVERT
        or boundary.active()
        or visible_damping(mode.program(jaxpr), mode.plan, body.consts) is None
    ):
        return options
    every = options.anchor_every
    if every is None:
        every = INT32_MAX if options.bound is None else max(options.bound, 1)
    return dataclasses.replace(options, anchor_every=every, check="warn")


def reporter(options: Options, body: TracedBody) -> Any:
    """The drift report of ``revnet.{loop}({body})``: the boundary check
    (:mod:`revnet._engine.boundary`) and the monitor's, or None without
    either."""
    source = f"revnet.{options.loop}({body.name})"
    every, bound = options.anchor_every, options.bound
    if every is None or every >= (INT32_MAX if bound is None else bound):
        every = None  # the initial carry only: no anchors of the user's
    monitor = None if options.drift is None else options.drift.reporter(source)
    check = boundary.reporter(source, body.carry, every, mode=options.check)
    return boundary.chained(check, monitor)


def call(loop: str, run: Callable[..., Any], *args: Any) -> Any:
    """``run(*args)``, naming revnet's loop when forward mode reaches it."""
    return reverse_mode_only(f"revnet.{loop}", run, *args)
