"""The plain reference's ``jax`` and ``revnet``: loops as Python loops, branches
as selects, nested ``jit``s and checkpoints as plain calls.
"""

import functools
import types

import jax
import jax.numpy as jnp


def py_scan(f, init, xs=None, length=None, reverse=False):
    """``lax.scan`` as a Python loop: the plain reference compiles nothing."""
    n = length if xs is None else jax.tree_util.tree_leaves(xs)[0].shape[0]
    carry, ys = init, [None] * n
    for i in reversed(range(n)) if reverse else range(n):
        x = None if xs is None else jax.tree_util.tree_map(lambda v: v[i], xs)
        carry, ys[i] = f(carry, x)
    if not n or ys[0] is None:
        return carry, None
    return carry, jax.tree_util.tree_map(lambda *v: jnp.stack(v), *ys)


def _py_fori_loop(lower, upper, body, init, unroll=None):
    """``lax.fori_loop`` as a Python loop."""
    del unroll
    carry = init
    for i in range(lower, upper):
        carry = body(i, carry)
    return carry


def _py_cond(pred, true_fun, false_fun, *operands):
    """``lax.cond`` as a select of both branches (finite in the programs)."""
    t, f = true_fun(*operands), false_fun(*operands)
    return jax.tree_util.tree_map(lambda u, v: jnp.where(pred, u, v), t, f)


def _py_switch(index, branches, *operands):
    """``lax.switch`` as a select of all branches (the index is clamped)."""
    index = jnp.clip(index, 0, len(branches) - 1)
    outs = [branch(*operands) for branch in branches]
    return jax.tree_util.tree_map(
        lambda *vs: functools.reduce(
            lambda acc, kv: jnp.where(index == kv[0], kv[1], acc), enumerate(vs), vs[0]
        ),
        *outs,
    )


class _Plain(types.SimpleNamespace):
    """A module's namespace with some names replaced (the plain reference's)."""

    def __init__(self, module, **replaced):
        super().__init__(_module=module, **replaced)

    def __getattr__(self, name):  # only names that are not replaced
        if name.startswith("__") or name == "_module":
            raise AttributeError(name)
        return getattr(self._module, name)


# The plain reference runs the program's loops as Python loops, its branches as
# selects, and its nested ``jit``s and checkpoints as plain calls: the same
# values, and no compilation per program.
PLAIN_JAX = _Plain(
    jax,
    jit=lambda f: f,
    checkpoint=lambda f, **_: f,
    lax=_Plain(
        jax.lax,
        scan=py_scan,
        fori_loop=_py_fori_loop,
        cond=_py_cond,
        switch=_py_switch,
    ),
)
PLAIN_REVNET = types.SimpleNamespace(scan=py_scan)
