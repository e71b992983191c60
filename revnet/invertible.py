"""``@invertible``: memory-efficient VJPs by running a function backwards.

:func:`invertible` traces a function to a jaxpr, decides whether its
equations can be run backwards, and installs a ``jax.custom_vjp`` whose
forward pass saves only the outputs (and the closed-over constants). The
backward pass rebuilds every input and intermediate from the outputs, in
lock-step with the cotangents, so none of the function's activations are
stored. :func:`inverse` runs the same plan on values alone.

**The transformation.** The engine (``revnet._engine``) propagates knowledge
to a fixed point, independently of the order of the equations. Start with the
outputs and the constants known; then, until nothing changes:

* an equation whose inputs are all known is evaluated *forward* (any
  primitive may be: ``relu``, ``dot``, ``conv``, dropout, ...);
* an equation whose outputs are known and whose inputs are all known but one
  is *solved* for that input by its inverse rule;
* nested calls (``jit``, ``custom_jvp_call``, ``custom_vjp_call``, ``remat``)
  are solved by analysing their body the same way, a ``scan`` whose body is
  invertible in its carry is run as a reversed scan, ``select_n`` with a known
  predicate is solved case by case, and ``slice`` equations that together
  cover an unknown value rebuild it.

If every input becomes known the function is invertible; otherwise
:class:`~revnet.NotInvertibleError` names the equation that could not be
solved, the input that could not be recovered, and the user's source line, and
for a common shape (a residual ``x + f(x)``, a reduction or ``relu`` on the
stream, a lossy cast, a singular matrix) adds one line starting with ``try:``.
This is checked when a call is traced, differentiated or not, so that a
function that cannot be inverted fails at its first call (a Haiku ``init``),
not at its first gradient.
In the backward pass, values evaluated forward come from ``jax.vjp``, so the
evaluation of ``F(x2)`` that rebuilds ``x1 = y1 - F(x2)`` is the one whose VJP
is taken (RevNet's 4/3 cost, not 3/2).

**Registering a rule.** A primitive the analysis cannot solve gets an inverse
rule with :func:`revnet.register_inverse`::

    def sinh_inverse(outs, ins, **params):
        return [jnp.arcsinh(outs[0])]

    revnet.register_inverse(jax.extend.core.primitives.sinh_p, sinh_inverse)

and a whole function gets a user-given inverse with :class:`revnet.custom_ivjp`
(see :mod:`revnet.ivjp`).

Plans are cached by the program's structure, so calling a decorated function
again, eagerly or under a new trace, does not analyse it again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from revnet._engine import (
    Interpreter,
    Storage,
    aval,
    known_args,
    plan_call,
    prepare,
    reverse_mode_only,
    reversible_call,
    runtime_checks,
    sharded_types,
    struct,
)

__all__ = ["inverse", "invertible"]


class Invertible:
    """A function decorated with :func:`invertible`: its options, and the call.

    Attributes:
      fun: The function.
      storage: What its forward pass stores (decisions, kinks).
      known_argnums: The positions of its known arguments.
    """

    def __init__(
        self,
        fun: Callable[..., Any],
        storage: Storage,
        known_argnums: tuple[int, ...] = (),
    ):
        # Names and docs only: copying ``fun.__dict__`` would replace ``self.fun``
        # by a ``custom_ivjp``'s own ``fun`` and drop its inverse.
        functools.update_wrapper(self, fun, updated=())
        self.fun = fun
        self.storage = storage
        self.known_argnums = known_argnums

    def __call__(self, *args, **kwargs):
        name = getattr(self.fun, "__name__", "function")
        # Keyword arguments are known: closed over, so saved and differentiated
        # like the values ``fun`` closes over.
        fun = functools.partial(self.fun, **kwargs) if kwargs else self.fun
        program = prepare(fun, args, self.known_argnums, self.storage, name=name)

        def again(flat_fun, flat_args):
            # Under jax.vmap: the batched program, traced and planned anew.
            p = plan_call(program.call, self.storage, fun=flat_fun, args=flat_args)
            return _call(p, again)

        outs = _call(program, again)
        return jax.tree_util.tree_unflatten(program.out_tree, outs)

    def inverse(self, *example_args):
        return inverse(self, *example_args, known_argnums=self.known_argnums)


def _call(program: Any, again: Callable[..., Any]) -> list:
    """The reversible call of ``program`` on its arguments. The plan is cached
    by structure; the call closes over this trace's jaxpr (its rules and
    nested constants)."""
    p = program
    return reverse_mode_only(
        f"revnet.invertible({p.call.name})",
        reversible_call.call,
        *(p.jaxpr, p.program, p.exposed, p.plan, p.consts, p.args, again, p.call.name),
    )


def invertible(
    fun: Callable[..., Any] | None = None,
    *,
    known_argnums: int | Sequence[int] = (),
    decisions: str = "store",
    kinks: str = "recompute",
) -> Callable[..., Any]:
    """Makes ``fun``'s VJP rebuild activations from outputs instead of storing them.

    The returned function computes the same values as ``fun``. Under
    ``jax.grad``/``jax.vjp`` its forward pass saves only the outputs and the
    values ``fun`` closes over; the backward pass runs ``fun``'s equations
    backwards to rebuild its inputs and intermediates while it computes the
    cotangents. Closed-over values (weights, Haiku parameters, keys) are
    constants of the inversion and receive correct gradients, also when they are
    tracers of an enclosing transformation.

    Savings come from ONE boundary around a whole stack of blocks: decorating
    each block separately saves nothing, because each block's outputs are the
    next block's inputs and would be stored. Loop a block with ``lax.scan``
    inside one ``@invertible`` function for memory independent of depth.

    Forward-mode differentiation (``jax.jvp``, ``jax.jacfwd``) is not
    available, as for any ``jax.custom_vjp`` function.

    **Decisions are stored.** A result whose value jumps (a comparison,
    ``sign``, ``round``/``floor``/``ceil``, ``rem``, ``reduce_precision``, a
    narrowing cast, ``argmax``, ``top_k``'s indices, a ``sort``'s order, an
    integer result such as ``jnp.searchsorted``'s) that reads a value the
    backward pass rebuilds is saved by the forward pass and used by the
    backward pass instead of being made again on rebuilt values, where
    rounding could flip it near a tie; also inside a ``lax.scan`` (once per
    step), ``jax.checkpoint``, ``lax.cond`` branch or ``custom_jvp`` function
    in ``fun``. Decisions reading only weights, constants or counters are
    recomputed. ``max``, ``min``, ``abs``, ``relu``, ``clamp``, reductions,
    pooling and selects whose cases agree where they switch (``leaky_relu``,
    ``elu``, ``hard_tanh``) are *kinks*: continuous in value, so they are
    recomputed, and at an exact tie their derivative follows the rebuilt
    value; ``kinks="store"`` stores them too. NaN/Inf tests are not
    decisions. :func:`revnet.decision` and :func:`revnet.kink` mark a select
    either way.

    Example::

        @revnet.invertible
        def block(x1, x2):
            y1 = x1 + jnp.tanh(x2 @ w1)
            y2 = x2 + jnp.tanh(y1 @ w2)
            return y1, y2

    With options, use ``@revnet.invertible(decisions="recompute")``.

    **Weights as arguments.** ``f(params, x)``, JAX's functional idiom, names
    ``params`` known: ``revnet.invertible(f, known_argnums=0)``. A known
    argument is not rebuilt from the outputs; it is saved like a closed-over
    value and differentiated like one::

        def stack(params, x):
            def layer(x, w):
                a, b = jnp.split(x, 2, -1)
                a = a + jnp.tanh(b @ w)
                return jnp.concatenate([b, a], -1), None
            return jax.lax.scan(layer, x, params)[0]

        loss = lambda p, x: jnp.sum(revnet.invertible(stack, known_argnums=0)(p, x))
        grads = jax.grad(loss, (0, 1))(jnp.zeros((8, 2, 2)), jnp.ones((3, 4)))

    **Keyword arguments** of a call (``f(x, context=c)``) are known, as the
    values ``fun`` closes over are: saved, not rebuilt, and differentiated.

    Args:
      fun: a function of positional arguments that are pytrees of arrays
        (floating, or integers updated invertibly such as counters), returning a
        pytree of arrays; it may take keyword arguments too, which are known.
      known_argnums: the positions of arguments that are not rebuilt (weights,
        parameters, conditioning inputs): saved by the forward pass like the
        values ``fun`` closes over, and differentiated. Their leaves may be of
        any type. At least one argument must be left to rebuild.
      decisions: ``"store"`` (the default) or ``"recompute"``: make decisions
        again on rebuilt values, storing none. Near a tie a recomputed
        decision can flip and the gradient then differs from ``jax.grad``'s.
      kinks: ``"recompute"`` (the default) or ``"store"``: also store every
        kink that reads rebuilt values (the branch of ``max``, ``min``,
        ``abs`` and ``relu`` as an int8 or bool per element; the inputs of
        other kinks), so that the derivative at an exact tie is
        ``jax.grad``'s; whatever ``decisions`` is.

    Returns:
      A function with the same signature and values as ``fun``.

    Raises:
      NotInvertibleError: at trace time, also of a call that is not
        differentiated, when ``fun`` cannot be inverted; the message names the
        primitive, the input that cannot be recovered and the source line, and
        may end with one ``try:`` line naming the remedy.
      ValueError: at trace time, for a decision reading rebuilt values that
        cannot be stored where it sits (inside a ``lax.while_loop`` or a
        ``shard_map``), naming it and what to do.
    """
    storage = Storage.checked("invertible", decisions=decisions, kinks=kinks)
    known = known_args.argnums(known_argnums, "invertible")
    if fun is None:
        return functools.partial(
            invertible, known_argnums=known, decisions=decisions, kinks=kinks
        )
    if isinstance(fun, Invertible):
        if (fun.storage, fun.known_argnums) == (storage, known):
            return fun
        fun = fun.fun
    if not callable(fun):
        raise TypeError(f"invertible expects a callable, got {fun!r}")
    return Invertible(fun, storage, known)


def _as_output(o: Any, want: Any, n: int, fname: str) -> jax.Array:
    """Output ``n`` given to an inverse, as an array of the type ``fun`` returns.

    Python scalars (and other weakly typed values) take the output's dtype
    where JAX would give them that dtype (``1`` or ``2.5`` for a float32
    output, not ``2.5`` for an int32 one); anything else must have its shape
    and dtype already.
    """
    x = jnp.asarray(o)
    dtype = jnp.result_type(x, want.dtype) if x.weak_type else x.dtype
    if x.shape != tuple(want.shape) or dtype != want.dtype:
        raise TypeError(
            f"inverse of {fname}: output {n} should be "
            f"{want.dtype}{list(want.shape)} as {fname} returns, got "
            f"{dtype}{list(x.shape)}"
        )
    return sharded_types.cast_like(
        x if x.dtype == want.dtype else x.astype(want.dtype), want
    )


def _auto_placement(a: Any) -> Any:
    """An example array's NamedSharding where it is not part of its type (Auto
    axes): the inverse places the rebuilt input the same way. Else None."""
    if not isinstance(a, jax.Array) or isinstance(a, jax.core.Tracer):
        return None
    s = getattr(a, "sharding", None)
    if not isinstance(s, jax.sharding.NamedSharding):
        return None
    if sharded_types.explicit_spec(jax.typeof(a), a.ndim) is not None:
        return None  # a type: cast_like already gave it
    return s


def _placed(x: Any, placement: Any) -> Any:
    if placement is None or getattr(x, "shape", None) is None:
        return x
    return jax.lax.with_sharding_constraint(x, placement)


def _example_struct(a: Any) -> jax.ShapeDtypeStruct:
    """The type of an example argument; an array's sharding is kept (under
    Explicit mesh axes it is part of the type)."""
    if isinstance(a, jax.ShapeDtypeStruct):
        return a
    if isinstance(a, (jax.Array, jax.core.Tracer)):
        return struct(jax.typeof(a))
    return jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a))


def inverse(
    fun: Callable[..., Any],
    *example_args: Any,
    known_argnums: int | Sequence[int] | None = None,
) -> Callable[[Any], tuple]:
    """Returns the inverse of ``fun``: outputs -> tuple of positional inputs.

    Args:
      fun: a plain function or one decorated with :func:`invertible`.
      *example_args: example positional arguments (arrays or
        ``jax.ShapeDtypeStruct``s); they give structure, shapes and dtypes only,
        except for known arguments, whose values the inverse uses.
      known_argnums: the arguments that are given, not rebuilt (weights): the
        inverse uses the values passed here and returns them as they are.
        Defaults to those of an :func:`invertible` function, else none.

    Returns:
      ``inv(outputs)``, taking exactly what ``fun`` returns as one argument and
      returning the tuple of ``fun``'s positional inputs (always a tuple, as with
      ``jax.vjp``'s cotangents).

    Raises:
      NotInvertibleError: when ``fun`` cannot be inverted.

    Example::

        inv = revnet.inverse(block, x1, x2)
        x1_again, x2_again = inv(block(x1, x2))
    """
    base = fun.fun if isinstance(fun, Invertible) else fun
    fname = getattr(base, "__name__", "function")
    if known_argnums is None:
        known_argnums = fun.known_argnums if isinstance(fun, Invertible) else ()
    known = known_args.given(known_argnums, example_args, fname)
    # Shapes and dtypes of the rebuilt arguments; the known ones as given.
    args = tuple(
        a if i in known else jax.tree_util.tree_map(_example_struct, a)
        for i, a in enumerate(example_args)
    )
    placements = [
        _auto_placement(a)
        for i, x in enumerate(example_args)
        if i not in known
        for a in jax.tree_util.tree_leaves(x)
    ]

    def program():
        return prepare(base, args, known, None, name=fname, traced=False)

    # Analyse once, now, so that errors surface at the call to ``inverse``.
    out_tree = program().out_tree

    def inv(outputs):
        # Re-trace so that closed-over values are those of the current context.
        p = program()
        flat_out, tree = jax.tree_util.tree_flatten(outputs)
        if tree != out_tree:
            raise TypeError(
                f"inverse of {fname}: expected outputs with structure {out_tree}, got "
                f"{tree}"
            )
        flat_out = [
            _as_output(o, aval(v), n, fname)
            for n, (o, v) in enumerate(zip(flat_out, p.jaxpr.outvars))
        ]
        with runtime_checks.scope() as sc:
            values = Interpreter(p.plan, p.jaxpr, list(p.consts), flat_out).values()
        runtime_checks.raise_if_failed(sc)
        values = [_placed(v, s) for v, s in zip(values, placements)]
        return p.call.inputs(values)

    return inv
