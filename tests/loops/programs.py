"""The loop tests' shared program: an additive coupling with closed-over
weights, stepped by ``revnet.while_loop`` and by ``lax.scan`` (the reference)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from revnet.loops import while_loop
from tests.helpers import compiled


def make_params(seed, d, dtype):
    k = jax.random.split(jax.random.PRNGKey(seed), 6)
    return {
        "w1": (jax.random.normal(k[0], (d, d)) / np.sqrt(d)).astype(dtype),
        "w2": (jax.random.normal(k[1], (d, d)) / np.sqrt(d)).astype(dtype),
        "b": (0.1 * jax.random.normal(k[2], (d,))).astype(dtype),
        "dt": jnp.asarray(0.3, dtype),
    }


def make_inputs(seed, batch, d, dtype):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed + 1000))
    return (
        jax.random.normal(k1, (batch, d)).astype(dtype),
        jax.random.normal(k2, (batch, d)).astype(dtype),
    )


def coupling_step(p, x1, x2):
    """An additive coupling with closed-over weights: invertible in (x1, x2)."""
    x1 = x1 + p["dt"] * jnp.tanh(x2 @ p["w1"] + p["b"])
    x2 = x2 + p["dt"] * jnp.tanh(x1 @ p["w2"])
    return x1, x2


def readout(x1, x2):
    return jnp.sum(jnp.sin(x1) * x2) + 0.5 * jnp.sum(x2**2)


def loss_scan_ref(p, x1, x2, n):
    """The reference: ``lax.scan`` over the known number of steps."""
    (y1, y2), _ = lax.scan(
        lambda c, _: (coupling_step(p, *c), None), (x1, x2), None, length=n
    )
    return readout(y1, y2)


def loss_while(p, x1, x2, cond, max_steps=None):
    """A while loop whose body closes over ``p`` (tracers of the outer grad)."""

    def body(c):
        x1, x2, i = c
        return (*coupling_step(p, x1, x2), i + 1)

    y1, y2, i = while_loop(cond, body, (x1, x2, 0), max_steps=max_steps)
    return readout(y1, y2), i


def compiled_grad(loss, *args):
    """``jax.grad`` of ``loss`` in every argument, compiled."""
    return compiled(jax.grad(loss, argnums=tuple(range(len(args)))), *args)


def memory_setup():
    """Parameters and inputs of the memory tests (width 64, batch 32)."""
    p = make_params(0, 64, jnp.float32)
    x1, x2 = make_inputs(0, 32, 64, jnp.float32)
    return p, x1, x2
