"""Running one program for the checker: its loss and gradients, the guard on
its plain intermediates, and what an exception after acceptance means.
"""

import jax
import jax.numpy as jnp
import numpy as np

import revnet
from tests.fuzz.compare import Redraw, Wrong
from tests.fuzz.families import BOUND
from tests.fuzz.programs import Program, build


def scalar_loss(outs):
    total = 0.0
    for y in outs:
        if jnp.finfo(y.dtype).bits < 32:
            y = y.astype(jnp.float32)
        total = total + jnp.sum(jnp.sin(y))
    return total


def value_and_grad(fun, holder, ws, a, b):
    def loss(ws, a, b):
        holder["ws"] = ws
        outs = fun(a, b)
        return scalar_loss(outs), outs

    try:
        return jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(ws, a, b)
    finally:
        holder["ws"] = ws


def guard(prog: Program, ws, a, b, s=None):
    """Raises Redraw when the plain forward pass has huge intermediates."""
    seen = []

    def probe(*xs):
        seen.extend(jax.tree_util.tree_leaves(xs))

    f, holder = build(prog, probe=probe)
    holder["ws"] = ws
    if s is not None:
        holder["s"] = s
    seen.extend(f(a, b))
    # In numpy: a jnp reduction would compile once per shape and dtype.
    sizes = [np.max(np.abs(np.asarray(x, np.float64))) for x in seen if np.size(x)]
    big = float(max(sizes, default=0.0))
    if not np.isfinite(big) or big > BOUND[prog.family]:
        raise Redraw(f"intermediate of size {big:.3g}")


def accepted_then(exc: BaseException, stage: str) -> tuple[str, str]:
    if isinstance(exc, Wrong):
        return "mismatch", f"{stage}: {exc}"
    if isinstance(exc, revnet.NotInvertibleError):
        return "wrong", f"{stage}: NotInvertibleError after acceptance: {exc}"
    return "error", f"{stage}: {type(exc).__name__}: {first_line(exc)}"


def first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:400] + ("..." if len(text) > 400 else "")
