"""A ``custom_ivjp`` function whose body decides, replayed with its decisions.

A ``custom_ivjp`` function is one unit of an inversion: the backward pass
rebuilds its inputs with the user's inverse and, unless the user gave a fused
``defivjp`` rule, differentiates its body at those rebuilt inputs. A decision
in the body (a spline's bucket: ``jnp.searchsorted``, ``x[..., None] >=
knots``, ``jnp.where(x > 0, ...)``) would then be made again on rebuilt
values, which differ from the forward ones by rounding: near a bucket's edge
it flips, and the cotangents follow the other bucket.

The decision pass (:meth:`~revnet._engine.decisions.nested.NestedCalls._custom_ivjp`)
splits such a call as it splits a ``remat``: a *deciding* call (a ``jit`` of
the body that returns its decisions too) runs in the forward pass, and a
*replaying* call stands for the function in the program the backward pass
inverts. The replaying call is a ``custom_ivjp`` call again, tagged with a
:class:`Replayed`: its first argument, a known constant, holds the values JAX
hoisted out of the body (arrays it closes over) and the decisions; its
inverse and log-determinant are the user's, and its cotangents come from the
body at the rebuilt inputs with the forward pass's decisions: ``jax.grad``'s.
Where the decisions are not known (a program that holds the split call,
inverted with ``decisions="recompute"``), the call makes them again from its
rebuilt inputs, as the function itself would.
"""

from __future__ import annotations

from typing import Any

import jax

from revnet._engine import cotangents
from revnet._engine import jaxpr as jx


class Replayed:
    """The tag of a replaying call: the ``custom_ivjp`` protocol read by
    :mod:`revnet._engine.structural.calls`, around the function's own tag.

    The call's arguments are the tuple of the hoisted values and the
    decisions, then the function's own arguments.

    Args:
      fn: the function's own tag (``num_consts``, ``invert``, ``log_det``).
      deciding: the body returning the function's outputs, then the
        decisions; its inputs are the body's constants, then the call's
        (the hoisted values, then the function's own).
      replaying: the body taking the decisions as its last inputs.
      extras: the abstract values of the hoisted values and the decisions.
      n_hoisted: how many of ``extras`` are hoisted values.
      own: the abstract values of the function's own flat inputs.
      record: the function's record of the call: ``(in_tree, out_tree)``.
    """

    user_vjp = False  # its cotangents are the body's, with the decisions

    def __init__(self, fn, deciding, replaying, extras, n_hoisted, own, record):
        own_tree, self.out_tree = record
        self.fn, self.deciding, self.replaying = fn, deciding, replaying
        self.__name__ = fn.__name__
        self.num_consts = fn.num_consts + 1
        self.n_hoisted, self.n_extras = n_hoisted, len(extras)
        # The decisions, by position among the call's own flat inputs.
        self.remade = tuple(range(n_hoisted, len(extras)))
        leaf = jax.tree_util.tree_structure(0)
        extras_tree = jax.tree_util.treedef_tuple([leaf] * len(extras))
        in_tree = jax.tree_util.treedef_tuple((extras_tree, *own_tree.children()))
        self.trees = {jx.shapes_key([*extras, *own]): (in_tree, self.out_tree)}
        self.own_tree = own_tree
        self.vjp_fun = self._make_vjp_fun()

    def invert(self, consts: tuple, outputs: Any) -> tuple:
        return self.fn.invert(tuple(consts[1:]), outputs)

    def log_det(self, args: tuple) -> Any:
        return self.fn.log_det(tuple(args[1:]))

    def ivjp(self, consts: tuple, outputs: Any, cts: Any) -> tuple[tuple, tuple]:
        """The inputs, rebuilt by the user's inverse, and the cotangents of
        all arguments from the body at them with the decisions (made again
        from the rebuilt inputs where they are not known)."""
        inputs = self.invert(consts, outputs)
        return inputs, self._vjp(consts[0], (*consts[1:], *inputs), cts)

    def call(self, *flat: Any) -> list:
        """The call on the flat extras and the function's own flat inputs, as
        the flat list of its outputs."""
        n = self.n_extras
        args = jax.tree_util.tree_unflatten(self.own_tree, list(flat[n:]))
        return jax.tree_util.tree_leaves(self.vjp_fun(tuple(flat[:n]), *args))

    def _run(self, extras: tuple, args: tuple) -> Any:
        hoisted, decisions = extras[: self.n_hoisted], extras[self.n_hoisted :]
        flat = jax.tree_util.tree_leaves(args)
        if any(d is None for d in decisions):
            decisions = jx.eval_body(self.deciding, *hoisted, *flat)[
                self.out_tree.num_leaves :
            ]
        outs = jx.eval_body(self.replaying, *hoisted, *flat, *decisions)
        return jax.tree_util.tree_unflatten(self.out_tree, outs)

    def _vjp(self, extras: tuple, args: tuple, cts: Any) -> tuple:
        _, vjp = jax.vjp(lambda *a: self._run(extras, a), *args)
        zeros = tuple(
            None if x is None else cotangents.zeros(jax.typeof(x)) for x in extras
        )
        return (zeros, *vjp(cts))

    def _make_vjp_fun(self):
        @jax.custom_vjp
        def f(extras, *args):
            return self._run(extras, args)

        def fwd(extras, *args):
            return self._run(extras, args), (extras, args)

        def bwd(res, cts):
            extras, args = res
            return self._vjp(extras, args, cts)

        jx.tag(bwd, self)  # the analysis solves this call by the user's inverse
        f.defvjp(fwd, bwd)
        return f
