"""Tests of the engine itself: the rule table, structure-keyed plans, and
custom_ivjp's single-input form."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core

import revnet
from revnet._engine import registry, stats
from tests.helpers import (
    assert_trees_close,
    calls_of,
    check_against_autodiff,
    runtime_checks,
    tolerance,
)

DTYPES = ["float32", "float64"]


def _x(dtype, shape=(3, 4), seed=0):
    return jax.random.uniform(jax.random.key(seed), shape, dtype, -0.9, 0.9)


# --------------------------------------------------------------------------- #
# The rule table.


def test_registry_lists_rules_with_their_properties():
    names = registry.names()
    assert names == sorted(names)
    for name in ("exp", "erf_inv", "add", "select_n", "slice", "scan", "jit"):
        assert name in names
    assert registry.get("erf_inv").elementwise
    assert not registry.get("erf_inv").structural
    assert registry.get("dot_general").structural is False
    assert not registry.get("dot_general").elementwise
    for name in ("select_n", "slice", "scan", "custom_vjp_call", "custom_jvp_call"):
        assert registry.get(name).structural, name
    assert registry.get("no_such_primitive") is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unary", [jax.scipy.special.erfinv, jnp.tanh])
@pytest.mark.slow
def test_where_of_any_elementwise_rule_inverts(dtype, unary):
    # erf_inv has a rule and is elementwise: the select inverts it as it does tanh.
    with jax.enable_x64(dtype == "float64"):
        x = _x(dtype)
        m = x > 0.1

        def f(x):
            return jnp.where(m, unary(x / 2), 2 * x)

        check_against_autodiff(f, x)


def test_user_rule_may_ask_for_input_avals():
    seen = []

    def rule(outs, ins, *, in_avals, **params):
        seen.append(tuple(in_avals[0].shape))
        return [jnp.arcsin(outs[0])]

    revnet.register_inverse("sin", rule)
    try:
        assert registry.get("sin").takes_avals
        check_against_autodiff(jnp.sin, _x("float32"))
        assert seen and set(seen) == {(3, 4)}
    finally:
        registry.unregister("sin")


@pytest.mark.parametrize("elementwise", [False, True])
def test_user_rule_marked_elementwise_inverts_inside_where(elementwise):
    def rule(outs, ins, **params):
        return [jnp.arcsin(outs[0])]

    x = _x("float32") * 0.3
    m = x > 0

    def f(x):
        return jnp.where(m, jnp.sin(x), 2 * x)

    revnet.register_inverse("sin", rule, elementwise=elementwise)
    try:
        assert registry.get("sin").elementwise == elementwise
        if elementwise:
            check_against_autodiff(f, x)
        else:
            with pytest.raises(revnet.NotInvertibleError, match="select_n"):
                revnet.invertible(f)(x)
    finally:
        registry.unregister("sin")


def _raises(outs, ins, **params):
    raise RuntimeError("boom")


def _wrong_type(outs, ins, **params):
    return [outs[0].astype(jnp.int32)]


def _wrong_count(outs, ins, **params):
    return []


@pytest.mark.parametrize(
    "rule,reason",
    [
        (_raises, "its inverse rule raised RuntimeError: boom"),
        (_wrong_type, "returned int32[3, 4] for an input of type float32[3, 4]"),
        (_wrong_count, "returned list of 0, not a list of the equation's 1 inputs"),
    ],
    ids=["raises", "wrong_type", "wrong_count"],
)
def test_error_names_the_equation_whose_rule_failed_not_its_consequences(rule, reason):
    def coupling(x1, x2):
        y1 = x1 + jnp.tanh(x2)  # stuck only because x2 is not rebuilt
        y2 = jnp.sin(x2) + y1  # the rule of sin fails here
        return y1, y2

    assert registry.get("sin") is None  # no built-in rule to restore
    revnet.register_inverse("sin", rule)
    try:
        x = _x("float32")
        with pytest.raises(revnet.NotInvertibleError) as info:
            revnet.invertible(coupling)(x, x)
    finally:
        registry.unregister("sin")
    msg = str(info.value)
    assert "cannot solve `sin` at " in msg, msg
    assert reason in msg, msg
    line = coupling.__code__.co_firstlineno + 2
    assert f"test_engine.py:{line}" in msg, msg
    assert "operands are unknown" not in msg and "\n" not in msg


def _halves_by_slices(x):
    return x[..., :2], x[..., 2:]


def _halves_by_split(x):
    return tuple(jnp.split(x, 2, -1))


_HALVES = {
    "slices": _halves_by_slices,
    "split": _halves_by_split,
    "slices in a remat": jax.checkpoint(_halves_by_slices),
}


@pytest.mark.parametrize("halves", sorted(_HALVES))
def test_error_names_the_culprit_on_a_half_not_the_slice_missing_it(halves):
    """The slices cover ``x``; one half is not rebuilt because of the residual
    on it, which is what the refusal names, with its ``try:`` line."""

    def coupling(x):
        a, b = _HALVES[halves](x)
        b2 = b * (1 + b**2)  # the culprit
        return jnp.concatenate([b2 + jnp.tanh(a), a], -1)

    with pytest.raises(revnet.NotInvertibleError) as info:
        revnet.invertible(coupling)(jnp.ones((3, 4)))
    first, hint = str(info.value).split("\n")
    line = coupling.__code__.co_firstlineno + 2
    assert "cannot solve `mul` at " in first, first
    assert f"test_engine.py:{line}:" in first, first
    assert "residual x * f(x)" in first and "args[0]" in first, first
    assert hint.startswith("try: split the stream into halves"), hint


# --------------------------------------------------------------------------- #
# Plans keyed by structure: warm eager calls analyse nothing and print nothing.


@jax.custom_vjp
def _double(x):
    return 2.0 * x


_double.defvjp(lambda x: (2.0 * x, None), lambda _, c: (2.0 * c,))


def _net(x1, x2):
    y1 = x1 + jax.nn.relu(x2) + _double(x2)
    y2 = x2 + jnp.tanh(y1)
    return y1, y2


def _step(c, w):
    x1, x2 = c
    x1 = x1 + jax.nn.relu(x2 * w)
    x2 = x2 + jnp.tanh(x1)
    return (x1, x2), jnp.sum(x2)


def _step_tanh(c, w):
    x1, x2 = c
    x1 = x1 + jnp.tanh(x2 * w)
    x2 = x2 + jnp.tanh(x1)
    return (x1, x2), jnp.sum(x2)


def _count_printing():
    """Counts str()/repr()/pretty-printing of jaxprs and equations."""
    classes = [jex_core.Jaxpr, jex_core.ClosedJaxpr, jex_core.JaxprEqn]
    names = ("__str__", "__repr__", "pretty_print")
    return calls_of(*(vars(c)[n] for c in classes for n in names if n in vars(c)))


def _loss(f):
    def loss(*args):
        return sum(jnp.sum(jnp.sin(y)) for y in jax.tree_util.tree_leaves(f(*args)))

    return loss


def test_warm_eager_calls_do_not_analyse_or_print():
    x1, x2 = _x("float32", seed=1), _x("float32", seed=2)
    ws = _x("float32", (5, 4), seed=3)
    rnet = revnet.invertible(_net)

    def scan_loss(x1, x2):
        (y1, y2), ys = revnet.scan(_step, (x1, x2), ws)
        return jnp.sum(jnp.sin(y1)) + jnp.sum(y2 * y2) + jnp.sum(ys)

    def calls():
        return (
            jax.grad(_loss(rnet), (0, 1))(x1, x2),
            revnet.inverse(_net, x1, x2)(_net(x1, x2)),
            revnet.scan(_step, (x1, x2), ws),
            jax.grad(scan_loss, (0, 1))(x1, x2),
        )

    first = calls()  # warms the caches
    analyses, hits = stats["analyses"], stats["hits"]
    with _count_printing() as printed:
        for _ in range(3):
            again = calls()
    assert stats["analyses"] == analyses, "a warm eager call analysed again"
    assert stats["hits"] > hits
    assert printed == []
    assert_trees_close(again, first, tolerance("float32"), "repeat")
    # And the values are right.
    want = jax.grad(_loss(_net), (0, 1))(x1, x2)
    assert_trees_close(first[0], want, tolerance("float32"), "grad")
    assert_trees_close(
        first[1], (x1, x2), tolerance("float32", "round_trip"), "inverse"
    )


def _scaled_vjp(k):
    @jax.custom_vjp
    def f(x):
        return 2.0 * x

    f.defvjp(lambda x: (2.0 * x, None), lambda _, c: (k * c,))
    return f


def test_reused_plan_takes_rules_from_the_current_program():
    # Same structure, different user derivative rules: one plan, two rules.
    x1, x2 = _x("float32", seed=4), _x("float32", seed=5)
    grads = []
    for k in (2.0, 5.0):
        g = _scaled_vjp(k)

        def net(x1, x2, g=g):
            y1 = x1 + g(x2)
            return y1, x2 + jnp.tanh(y1)

        got = jax.grad(_loss(revnet.invertible(net)), (0, 1))(x1, x2)
        want = jax.grad(_loss(net), (0, 1))(x1, x2)
        assert_trees_close(got, want, tolerance("float32"), f"k={k}")
        grads.append(got)
    assert not np.allclose(grads[0][1], grads[1][1])


# --------------------------------------------------------------------------- #
# custom_ivjp.


def _affine(form):
    f = revnet.custom_ivjp(lambda x: 2.0 * x + 1.0)
    if form == "bare":
        f.definverse(lambda y: (y - 1.0) / 2.0)
    elif form == "tuple":
        f.definverse(lambda y: ((y - 1.0) / 2.0,))
    elif form == "bare_ivjp":
        f.defivjp(lambda y, c: ((y - 1.0) / 2.0, 2.0 * c))
    else:
        f.defivjp(lambda y, c: (((y - 1.0) / 2.0,), (2.0 * c,)))
    return f


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", ["bare", "tuple", "bare_ivjp", "tuple_ivjp"])
def test_custom_ivjp_of_one_input_may_return_the_bare_input(dtype, form):
    with jax.enable_x64(dtype == "float64"):
        x = _x(dtype)
        f = _affine(form)
        rtol = tolerance(dtype)
        want = jax.grad(lambda x: jnp.sum(jnp.sin(2.0 * x + 1.0)))(x)
        got = jax.grad(lambda x: jnp.sum(jnp.sin(f(x))))(x)
        assert_trees_close(got, want, rtol, "standalone")
        check_against_autodiff(lambda x: jnp.tanh(f(x)), x)


@pytest.mark.slow
def test_custom_ivjp_remembers_a_bounded_number_of_shapes():
    f = _affine("bare")
    for n in range(100):
        f(jnp.ones((n + 1,)))
    assert len(f.trees) <= f.trees.size < 100
    check_against_autodiff(lambda x: f(x), jnp.linspace(-1.0, 1.0, 7))


class _Compiles(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.names: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("Compiling "):
            self.names.append(message.split(" ")[1])


@pytest.mark.parametrize("step", [_step, _step_tanh], ids=["relu", "tanh"])
def test_warm_eager_scan_reuses_its_compiled_forward(step):
    x1, x2 = _x("float32", seed=6), _x("float32", seed=7)
    ws = _x("float32", (5, 4), seed=8)
    want = jax.lax.scan(step, (x1, x2), ws)
    assert_trees_close(
        revnet.scan(step, (x1, x2), ws), want, tolerance("float32"), "scan"
    )
    handler = _Compiles()
    logger = logging.getLogger("jax")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        with jax.log_compiles(True):
            got = revnet.scan(step, (x1, x2), ws)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert handler.names == []
    assert_trees_close(got, want, tolerance("float32"), "scan")


def test_zero_derivative_equations_send_no_cotangent():
    """``jax.nn.softmax`` holds ``stop_gradient(max(x))``: plain autodiff sends
    no cotangent into that ``max``, and neither may the reversed pass (it
    would add ``reduce_max``'s VJP over the whole logits to every block)."""

    def coupling(h, w):
        h1, h2 = jnp.split(h, 2, -1)
        y1 = h1 + jax.nn.softmax(h2 @ w) @ w.T
        return jnp.concatenate([h2, y1], -1)

    def loss(ws, x, invert):
        def stack(h):
            return jax.lax.scan(lambda h, w: (coupling(h, w), None), h, ws)[0]

        return jnp.sum(jnp.sin((revnet.invertible(stack) if invert else stack)(x)))

    ws, x = jnp.ones((4, 16, 24)) * 0.01, jnp.ones((8, 32))

    def compares_on_logits(invert):
        with runtime_checks(False):
            step = jax.jit(jax.grad(loss), static_argnums=2).lower(ws, x, invert)
        lines = step.as_text().splitlines()
        return sum("stablehlo.compare" in t and "8x24" in t for t in lines)

    assert compares_on_logits(True) <= compares_on_logits(False)


def test_a_plan_whose_step_needs_itself_raises_instead_of_hanging():
    """A handler whose ``needs`` names a value its own step makes (here the
    select's predicate, computed from what the select rebuilds) is a cycle in
    the plan: the interpreter names it rather than pushing steps for ever."""
    code = """
import jax, jax.numpy as jnp, revnet
from revnet._engine.structural import select
from revnet._engine.interpreter import _HANDLERS
from revnet._engine.plan import Select
h = _HANDLERS[Select]
own = h.needs
h.needs = lambda it, step: [*own(it, step), it.wiring.eqn_ins[step.eqn][0]]
x = jnp.array([-1.0, 2.0])
try:
    revnet.inverse(jax.nn.leaky_relu, x)(x)
except RuntimeError as e:
    print(e)
"""
    import os
    import subprocess
    import sys

    from tests.helpers import ROOT

    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "internal error: step" in proc.stdout, proc.stdout + proc.stderr
    assert "needs values that depend on itself" in proc.stdout
