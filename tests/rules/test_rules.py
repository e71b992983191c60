"""Tests of the inverse rules' errors, register_inverse and conversions (every
rule is checked against autodiff in ``tests/rules/test_coverage.py``;
``revnet.custom_ivjp`` is tested in ``tests/core/test_ivjp.py``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import revnet
from tests import fuzz as fz
from tests.helpers import check_against_autodiff, runtime_checks, tolerance


def _normal(seed, shape, dtype=jnp.float64):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def test_convert_element_type_widening_is_exact():
    with jax.enable_x64(True):
        x = _normal(0, (6, 4), jnp.float32)
        f = lambda x: x.astype(jnp.float64) * 2.0  # noqa: E731
        check_against_autodiff(f, x, rtol=1e-7)  # exact: a widening and a doubling


def test_convert_to_integer_is_rejected():
    with pytest.raises(revnet.NotInvertibleError, match="floating types"):
        revnet.invertible(lambda x: x.astype(jnp.int32))(jnp.ones(3))


# --------------------------------------------------------------------------- #
# Errors, also at the start or end of random invertible programs (the random
# invertible programs themselves are checked in ``tests/fuzz/test_fuzz.py``).

_BREAKERS = [
    ("x * x", lambda x: x * x, "used more than once"),
    ("x * exp(x)", lambda x: x * jnp.exp(x), "residual x * f(x)"),
    ("sum", lambda x: jnp.sum(x, -1, keepdims=True) + x * 0.0, ""),
    ("relu", jax.nn.relu, "`max`"),
    ("abs", jnp.abs, "`abs` has no inverse rule"),
    ("even power", lambda x: x**2, "even power"),
    ("broadcast add", lambda x: x[..., :1] + jnp.zeros_like(x), ""),
]


# Constructs the random programs always expect to be accepted.
_INVERTIBLE = ("unary", "coupling", "mix", "halves", "dot")


def _breaker_params():
    for which, (label, breaker, _) in enumerate(_BREAKERS):
        for n, at in enumerate(["start", "end", "start", "end"]):
            index = 4 * which + n
            yield pytest.param(breaker, at, index, id=f"{label}-{at}-{index}")


@pytest.mark.parametrize("breaker,at,index", _breaker_params())
def test_random_programs_with_a_non_invertible_step_raise(breaker, at, index):
    prog = fz.draw_program(11, index, _INVERTIBLE)
    f, holder = fz.build(prog)

    def g(a, b):
        if at == "start":
            a = breaker(a)
        a, b = f(a, b)
        if at == "end":
            b = breaker(b)
        return a, b

    with jax.enable_x64(fz.FAMILIES[prog.family][1]):
        holder["ws"], a, b = fz.materialise(prog)
        jax.eval_shape(revnet.invertible(f), a, b)  # the program alone is accepted
        with pytest.raises(revnet.NotInvertibleError):
            revnet.invertible(g)(a, b)
        with pytest.raises(revnet.NotInvertibleError):
            revnet.inverse(g, a, b)


@pytest.mark.parametrize("label,fun,reason", _BREAKERS, ids=[b[0] for b in _BREAKERS])
def test_error_names_primitive_input_and_user_line(label, fun, reason):
    x = jnp.ones((2, 4))
    with pytest.raises(revnet.NotInvertibleError) as info:
        revnet.invertible(fun)(x)
    msg, *hint = str(info.value).split("\n")
    assert "args[0]" in msg and "cannot solve `" in msg
    assert reason in msg
    assert "test_rules.py" in msg, msg  # the user's line, even inside relu
    # At most one more line: the hint (tests/core/test_hints.py checks which).
    assert len(hint) <= 1 and all(h.startswith("try: ") for h in hint), hint


def test_unused_input_is_reported():
    with pytest.raises(revnet.NotInvertibleError, match=r"args\[1\]"):
        revnet.invertible(lambda a, b: a * 2.0)(jnp.ones(2), jnp.ones(2))


def test_dropped_output_is_reported():
    with pytest.raises(revnet.NotInvertibleError, match="`split`.*not all of its"):
        revnet.invertible(lambda x: jnp.split(x, 2)[0])(jnp.ones(4))


def test_scan_with_unused_ys_is_inverted():
    def f(x):
        return jax.lax.scan(lambda c, w: (c * 1.5 + w, c), x, jnp.arange(3.0))[0]

    with jax.enable_x64(True):
        check_against_autodiff(f, _normal(0, (3,)))


def test_broadcast_operand_is_not_invertible():
    with pytest.raises(revnet.NotInvertibleError, match="broadcast"):
        revnet.invertible(lambda a: a + jnp.ones((3, 2)))(jnp.ones(2))


def test_select_n_with_a_known_case_is_rejected():
    mask = np.arange(4) % 2 == 0
    with pytest.raises(revnet.NotInvertibleError, match="select_n"):
        revnet.invertible(lambda x: jnp.where(mask, x, 0.0))(jnp.ones(4))


def test_select_n_inside_a_coupling():
    mask = np.arange(4) % 2 == 0

    def f(a, b):
        return jnp.where(mask, a + jnp.tanh(b), a), b

    check_against_autodiff(f, jnp.linspace(-1, 1, 4), jnp.linspace(0, 2, 4))


def test_dot_with_non_square_matrix_is_rejected():
    m = jnp.ones((4, 3))
    with pytest.raises(revnet.NotInvertibleError, match="square"):
        revnet.invertible(lambda x: x @ m)(jnp.ones((2, 4)))


def test_gather_that_drops_elements_is_rejected():
    idx = np.array([0, 2, 3], np.int32)
    with pytest.raises(revnet.NotInvertibleError, match="only a permutation"):
        revnet.invertible(lambda x: x[..., idx])(jnp.ones((2, 4)))


def test_gather_that_reads_an_element_twice_is_reported():
    """Same size, not a permutation: the elements read twice or never are
    rebuilt as NaN, never as a finite wrong value, and the run-time checks
    name the gather and why."""
    idx = np.array([0, 0, 1, 2], np.int32)
    f = lambda x: x[..., idx]  # noqa: E731
    x = jnp.arange(8.0).reshape(2, 4)
    with runtime_checks(False):
        (back,) = revnet.inverse(f, x)(f(x))
    np.testing.assert_array_equal(np.isnan(back), [[1, 0, 0, 1]] * 2)
    np.testing.assert_array_equal(back[:, 1:3], x[:, 1:3])
    with runtime_checks(True), pytest.raises(Exception, match="not a permutation"):
        jax.block_until_ready(revnet.inverse(f, x)(f(x)))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gather_by_a_permutation_passed_as_an_argument(dtype):
    """Indices that are an argument (known, not constant) are a run-time
    permutation: inverted, with plain autodiff's gradients."""
    with jax.enable_x64(dtype == "float64"):
        perm = jnp.asarray([2, 0, 3, 1], jnp.int32)
        x = _normal(1, (3, 4), dtype)
        inv = revnet.inverse(lambda p, x: x[:, p], perm, x, known_argnums=(0,))
        np.testing.assert_array_equal(inv(x[:, perm])[1], x)
        g = revnet.invertible(lambda p, x: x[:, p] * 3.0, known_argnums=(0,))
        loss = lambda h: lambda x: jnp.sum(jnp.sin(h(perm, x)))  # noqa: E731
        got = jax.grad(loss(g))(x)
        want = jax.grad(loss(lambda p, x: x[:, p] * 3.0))(x)
        np.testing.assert_allclose(got, want, rtol=tolerance(dtype))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_sort_on_the_stream_is_inverted_by_its_stored_permutation(dtype):
    """``sort`` jumps: its permutation is stored as a decision, and the gather
    by it is inverted. A bare inverse has no stored permutation: refused."""
    with jax.enable_x64(dtype == "float64"):
        x = _normal(2, (4, 5), dtype)
        f = lambda x: jnp.sort(x, axis=-1) * 2.0  # noqa: E731
        loss = lambda f: lambda x: jnp.sum(jnp.sin(f(x)))  # noqa: E731
        got = jax.grad(loss(revnet.invertible(f)))(x)
        np.testing.assert_allclose(got, jax.grad(loss(f))(x), rtol=tolerance(dtype))
        kept = revnet.stored(loss(revnet.invertible(f)), x).entries
        assert [(e.kind, e.dtype) for e in kept if e.kind == "decision"] == [
            ("decision", jnp.dtype("int32"))
        ]
        with pytest.raises(revnet.NotInvertibleError, match="`sort` has no inverse"):
            revnet.inverse(f, x)


# --------------------------------------------------------------------------- #
# register_inverse.


def test_register_inverse_adds_a_rule():
    from jax.extend.core import primitives

    x = jnp.linspace(0.1, 0.9, 5)
    with pytest.raises(revnet.NotInvertibleError, match="`sin` has no inverse rule"):
        revnet.invertible(jnp.sin)(x)

    def sin_inverse(outs, ins, **params):  # valid on (-pi/2, pi/2)
        return [jnp.arcsin(outs[0])]

    revnet.register_inverse(primitives.sin_p, sin_inverse)
    try:
        check_against_autodiff(jnp.sin, x)
    finally:
        from revnet._engine import registry

        registry.unregister("sin")


def test_register_inverse_rejects_bad_arguments():
    with pytest.raises(TypeError, match="callable"):
        revnet.register_inverse("sin", 3)
    with pytest.raises(TypeError, match="primitive or its name"):
        revnet.register_inverse(3.0, lambda *a, **k: None)


def test_inverse_rules_accept_unknown_params():
    from revnet._engine import registry

    rule = registry.get("exp")
    out = rule.solve([jnp.ones(2)], [None], accuracy=None, some_future_param=1)
    np.testing.assert_allclose(out[0], 0.0)
