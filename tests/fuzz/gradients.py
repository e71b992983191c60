"""Custom-gradient rules that the random programs call by name.

Each is identity-like or simple forward, with a backward pass (or tangent)
that plain autodiff would not give: revnet must use the rule, not the body.
Their names appear in the printed source of a program
(:func:`~tests.fuzz.programs.build` puts them in its namespace).
"""

import functools

import jax
import jax.numpy as jnp


@jax.custom_vjp
def grad_reverse(x):
    """Identity forward; the backward pass negates the cotangent."""
    return x


grad_reverse.defvjp(lambda x: (x, None), lambda _, g: (-g,))

CLIP = 0.3


@jax.custom_vjp
def grad_clip(x):
    """Identity forward; the backward pass clips the cotangent to [-CLIP, CLIP]."""
    return x


grad_clip.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -CLIP, CLIP),))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def grad_scale(s, x):
    """Identity forward; the backward pass scales the cotangent by static ``s``."""
    return x


grad_scale.defvjp(lambda s, x: (x, None), lambda s, _, g: (g * s,))


def grad_scaler(s):
    """A fresh ``custom_vjp`` whose backward pass closes over ``s``."""

    @jax.custom_vjp
    def scaled(x):
        return x

    scaled.defvjp(lambda x: (x, None), lambda _, g: (g * s,))
    return scaled


@jax.custom_jvp
def ste_scale(x):
    """``3 x`` forward, straight-through (identity) tangent."""
    return x * 3.0


ste_scale.defjvp(lambda p, t: (ste_scale(p[0]), t[0]))


@jax.custom_jvp
def ste_sinh(x):
    """``sinh(x / 2)`` forward, tangent ``t / 2`` (the ``cosh`` is dropped)."""
    return jnp.sinh(x * 0.5)


ste_sinh.defjvp(lambda p, t: (ste_sinh(p[0]), t[0] * 0.5))


@jax.custom_jvp
def ste_asinh(x):
    """``asinh(x)`` forward, tangent ``t / (1 + x^2)`` (not the true one)."""
    return jnp.arcsinh(x)


ste_asinh.defjvp(lambda p, t: (ste_asinh(p[0]), t[0] / (1.0 + p[0] * p[0])))


@jax.custom_jvp
def ste_round(x):
    """``round(x)`` forward, straight-through tangent: a decision in a body."""
    return jnp.round(x)


ste_round.defjvp(lambda p, t: (ste_round(p[0]), t[0]))


@jax.custom_vjp
def ste_sign(x):
    """``sign(x)`` forward, the cotangent passed through: a decision in a body."""
    return jnp.sign(x)


ste_sign.defvjp(lambda x: (jnp.sign(x), None), lambda _, g: (g,))
