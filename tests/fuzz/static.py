"""The ``static_jit`` construct: a module-level reversible function run in a
jitted training step whose static hyper-parameter forces a retrace, and its
check.
"""

import functools

import jax
import numpy as np

import revnet
from tests.fuzz.compare import Redraw, all_zero, compare
from tests.fuzz.evaluate import (
    accepted_then,
    first_line,
    guard,
    scalar_loss,
    value_and_grad,
)
from tests.fuzz.programs import Program, build, materialise, tied
from tests.helpers import tolerance

# The module-level reversible function of the ``static_jit`` construct. Its body
# runs the program under test, which reads its static hyper-parameter from the
# program's ``holder`` (set by the jitted step below at trace time).
CTX: dict = {}


def static_body(a, b):
    """Runs ``CTX["f"]``: the program under test in the ``static_jit`` mode."""
    return CTX["f"](a, b)


# Kinks are stored: programs with decisions start from tied inputs, where a
# relu's derivative at an exact zero would follow the rebuilt value.
STATIC_INVERTIBLE = revnet.invertible(static_body, kinks="store")


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def static_step(ws, a, b, s, token, rev):
    """The jitted training step of ``static_jit``: ``s`` is static, so it retraces.

    Args:
      ws: the weights dict.
      a: first stream.
      b: second stream.
      s: the static hyper-parameter, read by the program's ``custom_vjp``.
      token: identifies the program (a new program must retrace).
      rev: use the module-level :data:`STATIC_INVERTIBLE` (else the plain body).

    Returns:
      ``((loss, outputs), (grad_ws, grad_a, grad_b))``.
    """
    del token
    holder = CTX["holder"]

    def loss(ws, a, b):
        holder["ws"], holder["s"] = ws, s
        outs = (STATIC_INVERTIBLE if rev else static_body)(a, b)
        return scalar_loss(outs), outs

    return jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(ws, a, b)


def check_static(prog: Program, invertible) -> tuple[str, str]:
    del invertible  # the module-level STATIC_INVERTIBLE is under test
    rtol = tolerance(prog.family, "fuzz")
    f, holder = build(prog)
    ws, a, b = materialise(prog)
    holder["ws"] = ws
    s1, s2 = (
        float(v)
        for v in np.random.default_rng([prog.seed, prog.index, 5]).choice(
            [0.5, 2.0, -1.0, 3.0], 2, replace=False
        )
    )
    guard(prog, ws, a, b, s1)
    CTX.update(f=f, holder=holder)
    token = (prog.seed, prog.index)
    try:
        wants = {}
        for s in (s1, s2):
            wants[s] = static_step(ws, a, b, s, token, False)
        if all_zero(
            jax.tree_util.tree_map(lambda x, y: x - y, wants[s1][1], wants[s2][1])
        ):
            raise Redraw("static_jit: the gradients do not depend on s")
        for stage, s in [("jit s1", s1), ("jit s2", s2), ("jit s1 again", s1)]:
            try:
                (_, outs), grads = static_step(ws, a, b, s, token, True)
            except revnet.NotInvertibleError as e:
                if stage == "jit s1":
                    return (
                        "wrong",
                        f"refused a program that must be accepted: {first_line(e)}",
                    )
                return accepted_then(e, stage)
            except Exception as e:  # noqa: BLE001
                return accepted_then(e, stage)
            try:
                compare(outs, wants[s][0][1], rtol, f"{stage} (s={s}) values")
                compare(grads, wants[s][1], rtol, f"{stage} (s={s}) grads")
            except Exception as e:  # noqa: BLE001
                return accepted_then(e, stage)
        for stage, s in [("eager s1", s1), ("eager s2", s2)]:
            try:
                holder["s"] = s
                (_, outs), grads = value_and_grad(STATIC_INVERTIBLE, holder, ws, a, b)
                compare(grads, wants[s][1], rtol, f"{stage} (s={s}) grads")
                if not tied(prog):  # see _check
                    back = revnet.inverse(STATIC_INVERTIBLE, a, b)(outs)
                    compare(tuple(back), (a, b), rtol, f"{stage} inverse")
            except Exception as e:  # noqa: BLE001
                return accepted_then(e, stage)
    finally:
        CTX.clear()
    return "accepted", ""
