"""Tests of the inverse rules, register_inverse, random invertible programs and
errors (``revnet.custom_ivjp`` is tested in ``tests/test_ivjp.py``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import revnet
from tests.helpers import assert_trees_close, check_against_autodiff


def _normal(seed, shape, dtype=jnp.float64):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


@jax.custom_jvp
def _exp2x(x):
    return jnp.exp(x) * 2.0


_exp2x.defjvp(lambda p, t: (_exp2x(p[0]), _exp2x(p[0]) * t[0]))


@jax.custom_vjp
def _times3(x):
    return x * 3.0


_times3.defvjp(lambda x: (x * 3.0, None), lambda _, g: (g * 3.0,))

_MASK = np.arange(24).reshape(6, 4) % 3 == 0
_M = np.eye(6) * 3.0 + np.arange(36.0).reshape(6, 6) / 40.0

RULE_CASES = {
    "add_sub_neg": lambda x: -(x + 1.5) - 0.5,
    "add_known_left": lambda x: 2.0 - x,
    "mul_div": lambda x: (x * 3.0) / 4.0,
    "div_unknown_denominator": lambda x: 2.0 / (jnp.exp(x) + 1.0),
    "exp_log": lambda x: jnp.log(jnp.exp(x) + 2.0),
    "log1p_expm1": lambda x: jnp.log1p(jnp.expm1(x) * 0.5 + 1.0),
    "tanh_atanh": lambda x: jnp.arctanh(jnp.tanh(x) * 0.5),
    "logistic": jax.nn.sigmoid,
    "sinh_asinh": lambda x: jnp.arcsinh(jnp.sinh(x) * 2.0),
    "odd_integer_pow": lambda x: x**3 + 1.0,
    "negative_odd_pow": lambda x: (jnp.exp(x) + 1.0) ** -3,
    "sqrt_nonnegative": lambda x: jnp.sqrt(jnp.exp(x)),
    "reshape_transpose": lambda x: jnp.transpose(x.reshape(3, 2, 4), (2, 0, 1)),
    "squeeze_expand": lambda x: jnp.squeeze(x[None, :, None, :], (0, 2)) * 2.0,
    "broadcast_unit": lambda x: jax.lax.broadcast_in_dim(x, (1, 6, 4), (1, 2)),
    "concatenate": lambda x: jnp.concatenate([x * 2.0, x[:0]], axis=0),
    "split": lambda x: jnp.split(x, [2, 5], axis=0),
    "slices_tile": lambda x: (x[:2] * 2.0, x[2:, :1], x[2:, 1:] + 1.0),
    "slices_halves": lambda x: (x[..., :2], jnp.exp(x[..., 2:])),
    "rev": lambda x: jnp.flip(x, (0, 1)),
    "copy": lambda x: jnp.array(x, copy=True) * 1.0,
    "cumsum": lambda x: jnp.cumsum(x, axis=0),
    "cumsum_reverse": lambda x: jax.lax.cumsum(x, axis=1, reverse=True),
    "select_n_known_predicate": lambda x: jnp.where(_MASK, x * 2.0 + 1.0, jnp.exp(x)),
    "select_n_conditional_update": lambda x: jnp.where(_MASK, x, x - 3.0),
    "dot_known_square_right": lambda x: (x.T @ _M).T,
    "dot_known_square_left": lambda x: _M @ x,
    "jit_call": jax.jit(lambda x: x * 2.0 + 1.0),
    "remat_call": jax.checkpoint(lambda x: jnp.exp(x) - 1.0),
    "custom_jvp_call": lambda x: _exp2x(x) + 1.0,
    "custom_vjp_call": lambda x: _times3(x) - 1.0,
    "scan_carry": lambda x: jax.lax.scan(
        lambda c, w: (c * 1.5 + w, None), x, jnp.arange(4.0)
    )[0],
    "scan_reverse_with_ys": lambda x: jax.lax.scan(
        lambda c, w: (c * 0.5 - w, jnp.sum(c)), x, jnp.arange(4.0), reverse=True
    ),
    "scan_unknown_xs": lambda x: jax.lax.scan(
        lambda c, r: (c, jnp.exp(r)), jnp.float64(0.0), x
    )[1],
}


@pytest.mark.parametrize("name", sorted(RULE_CASES))
@pytest.mark.slow
def test_rule_round_trip_and_vjp_float64(name):
    with jax.enable_x64(True):
        x = _normal(0, (6, 4)) * 0.5
        check_against_autodiff(RULE_CASES[name], x, rtol=1e-9)


@pytest.mark.parametrize(
    "name",
    [
        "add_sub_neg",
        "mul_div",
        "tanh_atanh",
        "slices_halves",
        "dot_known_square_left",
        "scan_carry",
    ],
)
def test_rule_round_trip_and_vjp_float32(name):
    x = _normal(0, (6, 4), jnp.float32) * 0.5
    check_against_autodiff(RULE_CASES[name], x, rtol=2e-5)


def test_convert_element_type_widening_is_exact():
    with jax.enable_x64(True):
        x = _normal(0, (6, 4), jnp.float32)
        check_against_autodiff(lambda x: x.astype(jnp.float64) * 2.0, x, rtol=1e-7)


def test_convert_to_integer_is_rejected():
    with pytest.raises(revnet.NotInvertibleError, match="floating types"):
        revnet.invertible(lambda x: x.astype(jnp.int32))(jnp.ones(3))


# --------------------------------------------------------------------------- #
# Random programs.

_UNARY = [
    ("scale", lambda x, c: x * (0.5 + c)),
    ("shift", lambda x, c: x + c),
    ("negate", lambda x, c: -x),
    ("divide", lambda x, c: x / (1.0 + c)),
    ("sinh", lambda x, c: jnp.sinh(x * 0.5)),
    ("asinh", lambda x, c: jnp.arcsinh(x)),
    ("cube", lambda x, c: 0.2 * x**3 + x * 0.0 if False else (x * 0.5) ** 3),
    ("tanh_scaled", lambda x, c: jnp.arctanh(jnp.tanh(x) * 0.5)),
    ("exp_log", lambda x, c: jnp.log(jnp.exp(x) + 1.0)),
    ("flip", lambda x, c: jnp.flip(x, -1)),
    ("cumsum", lambda x, c: jnp.cumsum(x, axis=-1) * 0.5),
]


def _coupling(w):
    return lambda x, c: None, w  # placeholder (couplings act on two streams)


@st.composite
def programs(draw):
    n_ops = draw(st.integers(1, 6))
    ops = []
    for _ in range(n_ops):
        kind = draw(st.sampled_from(["unary", "coupling", "mix", "halves", "dot"]))
        ops.append(
            (
                kind,
                draw(st.integers(0, 1)),
                draw(st.integers(0, len(_UNARY) - 1)),
                draw(st.floats(0.1, 1.0)),
            )
        )
    return ops


def _build(ops, ws):
    def f(a, b):
        streams = [a, b]
        for n, (kind, i, u, c) in enumerate(ops):
            j = 1 - i
            if kind == "unary":
                streams[i] = _UNARY[u][1](streams[i], c)
            elif kind == "coupling":  # forward-evaluated F, closes over weights
                streams[i] = streams[i] + jnp.tanh(streams[j] @ ws[n]) * c
            elif kind == "mix":  # relu only on the known path
                streams[i] = streams[i] - jax.nn.relu(streams[j]) * c
            elif kind == "halves":  # x[..., :h], x[..., h:] jointly
                h = streams[i].shape[-1] // 2
                lo, hi = streams[i][..., :h], streams[i][..., h:]
                streams[i] = jnp.concatenate([hi, lo * (1.0 + c)], -1)
            else:  # dot with a known, well-conditioned square matrix
                m = jnp.eye(ws.shape[-1], dtype=ws.dtype) + ws[n] * 0.1
                streams[i] = streams[i] @ m
        return tuple(streams)

    return f


@given(
    programs(),
    st.sampled_from(["float32", "float64"]),
    st.integers(1, 4),
    st.integers(0, 2**16),
)
@pytest.mark.slow
def test_random_invertible_programs(ops, dtype, batch, seed):
    with jax.enable_x64(dtype == "float64"):
        dt = jnp.dtype(dtype)
        d = 4
        ws = _normal(seed, (len(ops), d, d), dt) * 0.4
        a, b = _normal(seed + 1, (batch, d), dt), _normal(seed + 2, (batch, d), dt)

        def loss(ws, a, b, rev):
            f = _build(ops, ws)
            f = revnet.invertible(f) if rev else f
            return sum(jnp.sum(jnp.sin(y)) for y in f(a, b))

        grad = jax.jit(jax.grad(loss, (0, 1, 2)), static_argnums=3)
        got, want = grad(ws, a, b, True), grad(ws, a, b, False)
        rtol = 1e-4 if dt == jnp.float32 else 1e-9
        assert_trees_close(got, want, rtol, "grads (weights, a, b)")
        f = _build(ops, ws)
        back = revnet.inverse(f, a, b)(f(a, b))
        assert_trees_close(back, (a, b), rtol, "inverse")


_BREAKERS = [
    ("x * x", lambda x: x * x, "used more than once"),
    ("x * exp(x)", lambda x: x * jnp.exp(x), "2 operands are unknown"),
    ("sum", lambda x: jnp.sum(x, -1, keepdims=True) + x * 0.0, ""),
    ("relu", jax.nn.relu, "`max`"),
    ("abs", jnp.abs, "`abs` has no inverse rule"),
    ("even power", lambda x: x**2, "even power"),
    ("broadcast add", lambda x: x[..., :1] + jnp.zeros_like(x), ""),
]


@given(programs(), st.sampled_from(range(len(_BREAKERS))), st.integers(0, 6))
def test_random_programs_with_a_non_invertible_step_raise(ops, which, where):
    _, breaker, _ = _BREAKERS[which]
    ws = _normal(0, (len(ops), 4, 4), jnp.float32) * 0.4
    f = _build(ops, ws)
    at = min(where, len(ops))

    def g(a, b):
        if at == 0:
            a = breaker(a)
        a, b = f(a, b)
        if at > 0:
            b = breaker(b)
        return a, b

    x = _normal(1, (2, 4), jnp.float32)
    with pytest.raises(revnet.NotInvertibleError):
        revnet.invertible(g)(x, x)
    with pytest.raises(revnet.NotInvertibleError):
        revnet.inverse(g, x, x)


@pytest.mark.parametrize("label,fun,reason", _BREAKERS, ids=[b[0] for b in _BREAKERS])
def test_error_names_primitive_input_and_user_line(label, fun, reason):
    x = jnp.ones((2, 4))
    with pytest.raises(revnet.NotInvertibleError) as info:
        revnet.invertible(fun)(x)
    msg = str(info.value)
    assert "args[0]" in msg and "cannot solve `" in msg
    assert reason in msg
    assert "test_rules.py" in msg, msg  # the user's line, even inside relu
    assert "\n" not in msg


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
