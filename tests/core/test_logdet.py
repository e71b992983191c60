"""revnet.forward_and_log_det: the log-determinant derived from the program,
checked against ``slogdet(jax.jacfwd(flattened map))`` in float64 on CPU."""

import doctest
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import revnet
from revnet._engine import registry
from tests.helpers import (
    compiled,
    equations,
    flop_count,
    per_example_slogdet,
    runtime_checks,
    slogdet_reference,
    temp_size,
    tolerance,
)

RTOL = tolerance("float64", "log_det")  # against slogdet(jacfwd)
ATOL = tolerance("float64", "log_det_floor")  # for log-dets of zero


def derived(f, known, x):
    n = tuple(range(len(known)))
    return revnet.forward_and_log_det(f, *known, x, known_argnums=n)


def _x(shape=(3, 4), seed=0, lo=None, hi=None):
    x = jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float64)
    if lo is not None:
        x = jax.random.uniform(jax.random.PRNGKey(seed), shape, jnp.float64, lo, hi)
    return x


def _w(n=4, seed=1):
    return jax.random.normal(
        jax.random.PRNGKey(seed), (n, n), jnp.float64
    ) + 2 * jnp.eye(n)


def coupling(w, x):
    a, b = jnp.split(x, 2, -1)
    s = jnp.tanh(a @ w)
    return jnp.concatenate([b * jnp.exp(s) + s, a], -1)


def _custom_jvp_exp():
    @jax.custom_jvp
    def f(x):
        return jnp.exp(x)

    f.defjvp(lambda p, t: (jnp.exp(p[0]), jnp.exp(p[0]) * t[0]))
    return f


def _leaky_layers(ws, x):
    """Couplings scanned over layers, each followed by a leaky ReLU on the
    stream: a decision per layer, which the plan stores (a scan output of shape
    ``[layers, batch, ...]``)."""

    def layer(h, w):
        h = coupling(w, h)
        return jnp.where(h > 0, h, 0.5 * h), None

    return lax.scan(layer, x, ws)[0]


def _nested_leaky_layers(ws, x):
    """:func:`_leaky_layers` in groups: decisions of shape ``[groups, layers,
    batch, ...]``."""
    return lax.scan(lambda h, w: (_leaky_layers(w, h), None), x, ws)[0]


# name -> (function, known arguments, input). Every construct the rules solve.
UNARY_DOMAINS = {
    "exp": (jnp.exp, None),
    "log": (jnp.log, (0.1, 3.0)),
    "exp2": (jnp.exp2, None),
    "log1p": (jnp.log1p, (-0.9, 3.0)),
    "expm1": (jnp.expm1, None),
    "tanh": (jnp.tanh, None),
    "atanh": (jnp.arctanh, (-0.95, 0.95)),
    "logistic": (jax.nn.sigmoid, None),
    "sinh": (jnp.sinh, None),
    "asinh": (jnp.arcsinh, None),
    "sqrt": (jnp.sqrt, (0.1, 3.0)),
    "rsqrt": (lax.rsqrt, (0.1, 3.0)),
    "cbrt": (jnp.cbrt, (0.2, 3.0)),
    "erf_inv": (lax.erf_inv, (-0.9, 0.9)),
}


def _cases():
    w2 = _w(2)
    layers = jnp.stack([w2, -w2, 0.5 * w2])
    cases = {}
    for name, (fn, dom) in UNARY_DOMAINS.items():
        lo, hi = dom if dom else (None, None)
        cases[name] = (fn, (), _x(lo=lo, hi=hi))
    cases.update(
        {
            "mul by a known value": (lambda k, x: x * k, (_x((4,), 3),), _x()),
            "mul by a literal": (lambda x: -2.5 * x, (), _x()),
            "div by a known value": (lambda k, x: x / k, (_x((3, 4), 4),), _x()),
            "known value over x": (lambda x: 3.0 / x, (), _x(lo=0.5, hi=2.0)),
            "odd integer power": (lambda x: x**3 + 1.0, (), _x()),
            "negative odd power": (lambda x: x**-3, (), _x(lo=0.5, hi=2.0)),
            "dot with a known matrix": (lambda w, x: x @ w, (_w(),), _x()),
            "known matrix times x": (lambda w, x: w[:3, :3] @ x, (_w(),), _x()),
            "dot on axis 0": (
                lambda w, x: jnp.einsum("ij,ik->kj", x, w[:3, :3]),
                (_w(),),
                _x(),
            ),
            "cumsum": (lambda x: jnp.cumsum(x, 1) * 2.0, (), _x()),
            # x[..., perm]: a gather that permutes each example's features.
            "permuting gather": (
                lambda x: jnp.tanh(x[..., np.array([2, 0, 3, 1])] * 1.5),
                (),
                _x(),
            ),
            # ... and written back by a scatter, as an inverse permutation is.
            "permuting scatter": (
                lambda x: jnp.zeros_like(x).at[:, np.array([2, 0, 3, 1])].set(2 * x),
                (),
                _x(),
            ),
            "reverse cumsum": (lambda x: lax.cumsum(x, 0, reverse=True), (), _x()),
            "layout": (
                lambda x: jnp.transpose(jnp.reshape(x[:, ::-1], (2, 6)))[::-1] * 1.5,
                (),
                _x(),
            ),
            # jnp.roll on the feature axis: slices and a concatenate whose
            # axis JAX gives as a NumPy integer.
            "roll on a feature axis": (
                lambda x: jnp.roll(jnp.exp(x), 1, axis=-1),
                (),
                _x(),
            ),
            "per-example layout": (
                lambda x: (
                    jnp.reshape(
                        jnp.transpose(x.reshape(-1, 2, 2), (0, 2, 1))[:, ::-1],
                        (x.shape[0], 4),
                    )
                    * 1.5
                ),
                (),
                _x(),
            ),
            "split and concatenate": (
                lambda x: jnp.concatenate(jnp.split(x, 2, 1)[::-1], 1) * 0.5,
                (),
                _x(),
            ),
            "widening cast": (
                lambda x: jnp.exp(x.astype(jnp.float64)),
                (),
                _x().astype(jnp.float32),
            ),
            "affine coupling": (coupling, (w2,), _x()),
            "leaky select": (lambda x: jnp.where(x > 0, x, 0.1 * x), (), _x()),
            "select with two bijections": (
                lambda x: jnp.where(x > 0, jnp.exp(x) - 1.0, 2.0 * x),
                (),
                _x(),
            ),
            "jax.nn.leaky_relu": (lambda x: jax.nn.leaky_relu(x, 0.2), (), _x()),
            "select by a known predicate": (
                lambda k, x: jnp.where(k > 0, jnp.exp(x), -3.0 * x),
                (_x((4,), 5),),
                _x(),
            ),
            "checkpoint": (jax.checkpoint(coupling), (w2,), _x()),
            "custom_jvp": (lambda x: _custom_jvp_exp()(x) * 2.0, (), _x()),
            "scan over layers": (
                lambda ws, x: lax.scan(lambda h, w: (coupling(w, h), None), x, ws)[0],
                (layers,),
                _x(),
            ),
            "scan with unknown xs": (
                lambda x: lax.scan(lambda c, r: (c + 1.0, jnp.exp(r) * c), 2.0, x)[1],
                (),
                _x(),
            ),
            "fori_loop": (
                lambda w, x: lax.fori_loop(0, 3, lambda i, h: coupling(w, h), x),
                (w2,),
                _x(),
            ),
            "scan storing a decision": (_leaky_layers, (layers,), _x((5, 4))),
            "nested scans storing decisions": (
                _nested_leaky_layers,
                (jnp.stack([layers, layers[::-1]]),),
                _x((5, 4)),
            ),
        }
    )
    return cases


with jax.enable_x64(True):
    CASES = _cases()


@pytest.mark.parametrize("name", list(CASES))
def test_log_det_equals_slogdet_of_the_jacobian(name):
    f, known, x = CASES[name]
    with jax.enable_x64(True):
        y, ld = jax.jit(lambda k, x: derived(f, k, x))(known, x)
        ref = jax.jit(lambda k, x: slogdet_reference(f, k, x))(known, x)
        np.testing.assert_allclose(y, f(*known, x), rtol=tolerance("float64", "values"))
        np.testing.assert_allclose(ld, ref, rtol=RTOL, atol=ATOL)


def test_every_rule_declares_its_log_det():
    """Each rule in the registry either gives a term, says it is zero, or is
    refused by name: a new primitive's rule cannot silently give 0."""
    for name in registry.names():
        rule = registry.get(name)
        if rule.structural:
            continue
        assert (
            rule.log_det is None or rule.volume_preserving or callable(rule.log_det)
        ), name
    # The ones without a term are exactly those that have no log-determinant.
    none = [
        n
        for n in registry.names()
        if not registry.get(n).structural and registry.get(n).log_det is None
    ]
    assert none == ["all_gather"]


# The cases whose inverse program revnet does not invert again (or does not
# build): the inverse has no rule, or reads its unknown twice.
NOT_INVERTED_TWICE = {
    "logistic": "the inverse is log(y) - log1p(-y), a residual of y",
    "sqrt": "the inverse squares, reading y twice",
    "rsqrt": "the inverse squares, reading y twice",
    "cbrt": "the inverse cubes, reading y thrice",
    "odd integer power": "the inverse is a cube root of a residual",
    "negative odd power": "the inverse is a cube root of a residual",
    "erf_inv": "the inverse is erf, which has no inverse rule",
    "dot with a known matrix": "the inverse is a linear solve (no rule)",
    "known matrix times x": "the inverse is a linear solve (no rule)",
    "dot on axis 0": "the inverse is a linear solve (no rule)",
    "cumsum": "the inverse differences shifted copies of y",
    "reverse cumsum": "the inverse differences shifted copies of y",
    "widening cast": "the inverse narrows float64 to float32",
    "leaky select": "revnet.inverse cannot decide the predicate from y",
    "select with two bijections": "revnet.inverse cannot decide the predicate",
    "jax.nn.leaky_relu": "revnet.inverse cannot decide the predicate from y",
    "scan storing a decision": "revnet.inverse cannot decide the predicate",
    "nested scans storing decisions": "revnet.inverse cannot decide the predicate",
}


@pytest.mark.parametrize("name", [n for n in CASES if n not in NOT_INVERTED_TWICE])
def test_the_inverse_has_the_negative_log_det(name):
    f, known, x = CASES[name]
    n = tuple(range(len(known)))
    # The run-time checks add a failing step's index to an inverse scan's
    # carry, which the inverse of the inverse cannot rebuild.
    with jax.enable_x64(True), runtime_checks(False):
        y, ld = derived(f, known, x)
        inv = revnet.inverse(f, *known, x, known_argnums=n)

        def back(*args):
            return inv(args[-1])[-1]

        x_again, ld_inv = revnet.forward_and_log_det(back, *known, y, known_argnums=n)
        np.testing.assert_allclose(
            x_again,
            x,
            rtol=tolerance("float64", "round_trip"),
            atol=1e-14,  # tighter than the table's: the test is relative
        )
        np.testing.assert_allclose(ld_inv, -ld, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", list(CASES))
def test_log_dets_add_over_composition(name):
    """An affine coupling after each case: the log-det of the composition is
    the case's at x plus the coupling's at the case's output."""
    f, known, x = CASES[name]
    with jax.enable_x64(True):
        w = _w(2, seed=7)

        def g(y):
            rows = jnp.reshape(y.astype(jnp.float64), (-1, 4))
            return jnp.reshape(coupling(w, rows), y.shape)

        y, ld_f = derived(f, known, x)
        _, ld_g = derived(g, (), y)
        _, ld_gf = derived(lambda *a: g(f(*a)), known, x)
        np.testing.assert_allclose(ld_gf, ld_f + ld_g, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    "name", ["affine coupling", "scan over layers", "leaky select"]
)
def test_log_det_gradients_equal_those_of_the_reference(name):
    f, known, x = CASES[name]
    with jax.enable_x64(True):
        grads = jax.jit(jax.grad(lambda k, x: derived(f, k, x)[1], (0, 1)))(known, x)
        ref = jax.jit(jax.grad(lambda k, x: slogdet_reference(f, k, x), (0, 1)))(
            known, x
        )
        for a, b in zip(
            jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref)
        ):
            np.testing.assert_allclose(
                a,
                b,
                rtol=1e-9,  # gradients of log-dets: one derivative past RTOL's
                atol=ATOL,
            )


def _flow(ws, x):
    return lax.scan(lambda h, w: (coupling(w, h), None), x, ws)[0]


def _carried_flow(ws, x):
    """The same flow with the log-determinant carried through the loop."""

    def layer(c, w):
        h, total = c
        y, ld = revnet.forward_and_log_det(coupling, w, h, known_argnums=0)
        return (y, total + ld), None

    return lax.scan(layer, (x, jnp.zeros((), x.dtype)), ws)[0]


def _losses():
    def plain(ws, x):
        y, ld = revnet.forward_and_log_det(_flow, ws, x, known_argnums=0)
        return 0.5 * jnp.sum(y**2) - ld

    def decorated(ws, x):
        f = revnet.invertible(_flow, known_argnums=0)
        y, ld = revnet.forward_and_log_det(f, ws, x)
        return 0.5 * jnp.sum(y**2) - ld

    def carried(ws, x):
        y, ld = revnet.invertible(_carried_flow, known_argnums=0)(ws, x)
        return 0.5 * jnp.sum(y**2) - ld

    return plain, decorated, carried


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_reversible_log_det_gradients_equal_jax_grad(dtype):
    """Under revnet.invertible (decorated, or the log-det carried in the loop)
    the loss and its gradients equal plain autodiff's, for every leaf: within
    1e-11 in float64; in float32, no further from the float64 gradient than
    three times plain autodiff's own float32 error (the flow's rebuilt values
    round differently from the stored ones)."""
    with jax.enable_x64(True):
        ws = 0.5 * jax.random.normal(jax.random.PRNGKey(1), (6, 2, 2), jnp.float64)
        x = jax.random.normal(jax.random.PRNGKey(0), (5, 4), jnp.float64)
        plain, *reversible = _losses()
        exact = jax.jit(jax.value_and_grad(plain, (0, 1)))(ws, x)
        ws, x = ws.astype(dtype), x.astype(dtype)
        want = jax.jit(jax.value_and_grad(plain, (0, 1)))(ws, x)
        for loss in reversible:
            got = jax.jit(jax.value_and_grad(loss, (0, 1)))(ws, x)
            for g, w, e in zip(*map(jax.tree_util.tree_leaves, (got, want, exact))):
                assert g.dtype == dtype
                if dtype == jnp.float64:
                    np.testing.assert_allclose(
                        g,
                        w,
                        rtol=1e-11,  # float64: the docstring's bound
                        atol=1e-13,  # and its floor, for zero gradients
                    )
                else:
                    err = np.linalg.norm(np.asarray(g, np.float64) - e)
                    own = np.linalg.norm(np.asarray(w, np.float64) - e)
                    # 1e-7: float32's epsilon, for a leaf where own is zero
                    assert err <= 3 * own + 1e-7 * np.linalg.norm(e), (err, own)


def test_reversible_log_det_memory_is_flat_in_depth():
    """A 64-wide affine-coupling flow trained on -(log_prob + log_det): compiled
    temp memory within 2% from depth 8 to 128; plain autodiff grows."""
    x = jnp.ones((256, 64), jnp.float32)
    sizes = {}
    for name, loss in zip(("plain", "decorated", "carried"), _losses()):
        for depth in (8, 128):
            ws = jnp.zeros((depth, 32, 32), jnp.float32)
            sizes[name, depth] = temp_size(
                jax.jit(jax.grad(loss)).lower(ws, x).compile()
            )
    for name in ("decorated", "carried"):
        assert sizes[name, 128] <= 1.02 * sizes[name, 8], sizes
    assert sizes["plain", 128] > 8 * sizes["plain", 8], sizes
    assert sizes["plain", 8] > sizes["carried", 8], sizes


def test_refusals_name_what_is_wrong():
    with jax.enable_x64(True):
        x = _x()
        with pytest.raises(ValueError, match="takes 12 values to 24"):
            derived(lambda x: (x, 2.0 * x), (), x)
        with pytest.raises(ValueError, match="floating inputs"):
            revnet.forward_and_log_det(lambda n, x: x * 2.0, jnp.arange(3), x)


def _softplus(z):
    return np.logaddexp(0.0, z)


# The terms in closed form, for inputs where the naive ones overflow.
CLOSED_FORMS = {
    "tanh": (
        jnp.tanh,
        lambda x: 2 * (np.log(2.0) - np.abs(x) - _softplus(-2 * np.abs(x))),
    ),
    "logistic": (jax.nn.sigmoid, lambda x: -_softplus(-x) - _softplus(x)),
    "exp": (jnp.exp, lambda x: x),
    "sinh": (
        jnp.sinh,
        lambda x: np.abs(x) + _softplus(-2 * np.abs(x)) - np.log(2.0),
    ),
}


@pytest.mark.parametrize("name", list(CLOSED_FORMS))
def test_terms_at_extreme_inputs_are_finite_closed_forms(name):
    """At +-40, tanh and logistic round to +-1 (or 0) in float64, so the naive
    ``log(1 - tanh(x)**2)`` is -inf; at +-800, exp and sinh overflow to inf.
    Each example's term is finite and equals the closed form."""
    f, closed = CLOSED_FORMS[name]
    x = np.array([40.0, -40.0, 800.0, -800.0])
    with jax.enable_x64(True):
        _, log_det = revnet.forward_and_log_det(
            f, jnp.asarray(x)[:, None], batch_ndim=1
        )
    assert np.all(np.isfinite(log_det)), log_det
    np.testing.assert_allclose(log_det, closed(x), rtol=1e-14)  # float64 closed forms


def test_a_user_rule_with_a_term_gives_the_log_det():
    """``register_inverse(..., log_det=...)``: the user's term is used."""

    def asin(outs, ins, **params):
        return [jnp.arcsin(outs[0])]

    def log_cos(outs, ins, unknown, **params):
        return jnp.log(jnp.cos(ins[unknown]))

    revnet.register_inverse("sin", asin, elementwise=True, log_det=log_cos)
    try:
        with jax.enable_x64(True):
            x = _x(lo=-1.2, hi=1.2)
            _, log_det = derived(jnp.sin, (), x)
            np.testing.assert_allclose(
                log_det, slogdet_reference(jnp.sin, (), x), rtol=RTOL
            )
            np.testing.assert_allclose(log_det, np.sum(np.log(np.cos(x))), rtol=RTOL)
    finally:
        registry.unregister("sin")


def _sine(x):
    return jnp.sin(x) * 2.0  # refused here


def test_a_user_rule_without_a_term_is_refused_in_one_line():
    revnet.register_inverse("sin", lambda outs, ins, **p: [jnp.arcsin(outs[0])])
    try:
        with jax.enable_x64(True):
            x = _x(lo=-1.2, hi=1.2)
            np.testing.assert_allclose(revnet.inverse(_sine, x)(_sine(x))[0], x)
            with pytest.raises(revnet.NotInvertibleError) as refused:
                revnet.forward_and_log_det(_sine, x)
    finally:
        registry.unregister("sin")
    message = str(refused.value)
    assert "\n" not in message, message
    assert message.startswith(
        f"no log-determinant for `sin` at {__file__}:{_refused_line(_sine)}"
    ), message
    assert "its inverse rule gives no log-determinant term" in message, message


@pytest.mark.parametrize("reversible", [False, True], ids=["plain", "invertible"])
def test_a_parameter_only_matrix_term_is_computed_once_per_call(reversible):
    """``slogdet`` of a known matrix is one LU factorisation of that matrix per
    call, whatever the batch: not one per example (nor a batched one)."""
    f = lambda w, x: x @ w  # noqa: E731
    if reversible:
        f = revnet.invertible(f, known_argnums=0)

    def lus(batch, ndim):
        def call(w, x):
            return revnet.forward_and_log_det(f, w, x, known_argnums=0, batch_ndim=ndim)

        eqns = equations(call, _w(), jnp.ones((batch, 4), jnp.float64))
        return [tuple(e.invars[0].aval.shape) for e in eqns if e.primitive.name == "lu"]

    with jax.enable_x64(True):
        for ndim in (0, 1):
            assert lus(3, ndim) == lus(64, ndim) == [(4, 4)], ndim


def _no_term_ivjp():
    @revnet.custom_ivjp
    def double(x):
        return 2.0 * x

    double.definverse(lambda y: y / 2.0)
    return double


def _wrong_shape_ivjp():
    @revnet.custom_ivjp
    def halve(x):
        return 0.5 * x

    halve.definverse(lambda y: 2.0 * y)
    halve.deflogdet(lambda x: jnp.full((2,), -np.log(2.0)))
    return halve


def _mixes_examples(x):
    return jnp.cumsum(x, 0) * 2.0  # refused here


def _custom_ivjp_without_term(x):
    return _no_term_ivjp()(x) + 0.0  # refused here


def _custom_ivjp_term_of_the_wrong_shape(x):
    return _wrong_shape_ivjp()(x) + 0.0  # refused here


def _scan_on_a_case(x):
    step = lambda c, _: (jnp.exp(c), None)  # noqa: E731
    inner = lax.scan(step, x, None, length=2)[0]  # refused here
    return jnp.where(x > 0, inner, 2.0 * x)


def _refused_line(f) -> int:
    """The line of ``f`` marked ``# refused here``."""
    lines, first = inspect.getsourcelines(f)
    (line,) = [first + i for i, text in enumerate(lines) if "# refused here" in text]
    return line


@pytest.mark.parametrize(
    "f,batch_ndim,reason",
    [
        (_mixes_examples, 1, "mixes the batch's examples"),
        (_custom_ivjp_without_term, 0, "has no log-determinant; give it one"),
        (_custom_ivjp_term_of_the_wrong_shape, 1, r"has shape \(2,\)"),
        (_scan_on_a_case, 0, "a nested call or scan on a case of select_n"),
    ],
    ids=["mixes examples", "custom_ivjp without a term", "term's shape", "case"],
)
def test_log_det_refusals_are_one_line_naming_the_users_line(f, batch_ndim, reason):
    with jax.enable_x64(True), pytest.raises(revnet.NotInvertibleError) as refused:
        revnet.forward_and_log_det(f, _x(), batch_ndim=batch_ndim)
    message = str(refused.value)
    assert "\n" not in message, message
    assert re.search(reason, message), message
    at = f" at {__file__}:{_refused_line(f)}"
    assert re.search(re.escape(at) + r"[: ]", message), (at, message)


def _channel_flow(k, x):
    """A 1x1 convolution (a known channel matrix, as Glow writes it) and an
    affine coupling on an image batch."""
    y = jnp.einsum("bhwc,cd->bhwd", x, k)
    a, b = jnp.split(y, 2, -1)
    return jnp.concatenate([a, b * jnp.exp(jnp.tanh(a)) + a], -1)


PER_EXAMPLE = [
    "affine coupling",
    "scan over layers",
    "scan storing a decision",
    "nested scans storing decisions",
    "leaky select",
    "checkpoint",
    "dot with a known matrix",
    "cumsum",
    "permuting gather",
    "permuting scatter",
    "per-example layout",
    "roll on a feature axis",
    "mul by a known value",
]


@pytest.mark.parametrize("name", PER_EXAMPLE + ["1x1 convolution"])
def test_per_example_log_det(name):
    """batch_ndim=1: one log-determinant per example, each equal to its own
    ``slogdet(jacfwd)``; they sum to the scalar one."""
    with jax.enable_x64(True):
        if name == "1x1 convolution":
            f, known, x = _channel_flow, (_w(),), _x((2, 3, 3, 4))
        else:
            f, known, x = CASES[name]
        n = tuple(range(len(known)))

        @jax.jit
        def both(known, x):
            per = revnet.forward_and_log_det(
                f, *known, x, known_argnums=n, batch_ndim=1
            )
            return per[1], derived(f, known, x)[1]

        per, total = both(known, x)
        assert per.shape == (x.shape[0],)
        np.testing.assert_allclose(
            per, per_example_slogdet(f, known, x), rtol=RTOL, atol=ATOL
        )
        np.testing.assert_allclose(jnp.sum(per), total, rtol=RTOL)


@pytest.mark.parametrize(
    "f",
    [
        lambda x: jnp.cumsum(x, 0) * 2.0,  # along the batch axis
        lambda x: jnp.exp(x.reshape(4, 3)).reshape(3, 4),  # the batch axis merged
        lambda x: jnp.exp(x.T).T,  # moved, then solved
        lambda x: jnp.zeros_like(x).at[np.array([1, 2, 0])].set(x),  # examples
    ],
    ids=[
        "cumsum over the batch",
        "reshape across the batch",
        "transposed",
        "scattered across the batch",
    ],
)
def test_per_example_refuses_programs_that_mix_examples(f):
    with jax.enable_x64(True):
        x = _x()
        derived(f, (), x)  # one scalar is fine
        with pytest.raises(
            revnet.NotInvertibleError, match="mixes the batch's examples.*batch_ndim=0"
        ):
            revnet.forward_and_log_det(f, x, batch_ndim=1)


def test_per_example_log_det_carried_through_a_reversible_loop():
    """The per-example log-det as a loop carry of shape [batch], inside
    revnet.invertible: values and gradients equal plain autodiff's."""

    def carried(ws, x):
        def layer(c, w):
            h, total = c
            y, ld = revnet.forward_and_log_det(
                coupling, w, h, known_argnums=0, batch_ndim=1
            )
            return (y, total + ld), None

        return lax.scan(layer, (x, jnp.zeros(x.shape[:1], x.dtype)), ws)[0]

    def loss(f):
        def go(ws, x):
            y, ld = f(ws, x)
            return jnp.sum(jnp.sin(ld)) + 0.5 * jnp.sum(y**2)

        return go

    with jax.enable_x64(True):
        ws = 0.5 * jax.random.normal(jax.random.PRNGKey(1), (4, 2, 2), jnp.float64)
        x = _x((5, 4))
        want = jax.value_and_grad(loss(carried), (0, 1))(ws, x)
        got = jax.value_and_grad(
            loss(revnet.invertible(carried, known_argnums=0)), (0, 1)
        )(ws, x)
        for a, b in zip(
            jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
        ):
            np.testing.assert_allclose(
                a,
                b,
                rtol=1e-11,  # float64, as in the log-det gradients test above
                atol=1e-13,  # and its floor, for zero gradients
            )


def test_batch_ndim_is_checked():
    with jax.enable_x64(True):
        x = _x()
        with pytest.raises(ValueError, match="batch_ndim must be a non-negative int"):
            revnet.forward_and_log_det(jnp.exp, x, batch_ndim=-1)
        with pytest.raises(ValueError, match=r"leads with the batch's axes \(3,\)"):
            revnet.forward_and_log_det(
                lambda a, b: (jnp.exp(a), b * 2.0), x, x[:2], batch_ndim=1
            )


def test_docstring_example_runs():
    tests = doctest.DocTestFinder().find(revnet.forward_and_log_det, globs={})
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted >= 4 and result.failed == 0


def test_carrying_the_log_det_costs_at_most_5_percent_more_flops():
    """Four affine couplings unrolled inside revnet.invertible (XLA counts a
    loop body once, so the layers are unrolled): the gradient of a loss on the
    outputs and the carried per-example log-det against the same stack's
    gradient without it."""

    def stack(with_log_det):
        def body(ws, x):
            total = jnp.zeros(x.shape[:1], x.dtype)
            for i in range(ws.shape[0]):
                if with_log_det:
                    x, ld = revnet.forward_and_log_det(
                        coupling, ws[i], x, known_argnums=0, batch_ndim=1
                    )
                    total = total + ld
                else:
                    x = coupling(ws[i], x)
            return (x, total) if with_log_det else (x,)

        def loss(ws, x):
            out = revnet.invertible(body, known_argnums=0)(ws, x)
            return jnp.mean(0.5 * jnp.sum(out[0] ** 2, -1) - sum(out[1:], 0.0))

        return loss

    ws = jnp.full((4, 32, 32), 0.01, jnp.float32)
    x = jnp.ones((256, 64), jnp.float32)
    flops = [flop_count(compiled(jax.grad(stack(w)), ws, x)) for w in (False, True)]
    assert flops[0] < flops[1] <= 1.05 * flops[0], flops


def _gathered(rows: bool):
    """A permutation of the channels (or of the examples, ``rows``) as a
    ``custom_ivjp`` gather with a zero log-determinant."""

    def gather(idx, x):
        return x[idx] if rows else x[..., idx]

    f = revnet.custom_ivjp(gather, num_consts=1)
    inv = jnp.argsort(jnp.array([2, 0, 1, 3]))
    f.definverse(lambda idx, y: y[inv] if rows else y[..., inv])
    f.deflogdet(lambda idx, x: jnp.zeros(x.shape[:1], x.dtype))
    return lambda x: f(jnp.array([2, 0, 1, 3]), x) * 2.0


def test_per_example_reads_a_gather_through_its_dimension_numbers():
    """``x[..., perm]`` keeps each example's values; ``x[perm]`` mixes them."""
    x = _x((4, 4))
    _, log_det = revnet.forward_and_log_det(_gathered(False), x, batch_ndim=1)
    closed = 4 * np.log(2.0)
    np.testing.assert_allclose(log_det, closed, rtol=tolerance("float32", "values"))
    with pytest.raises(revnet.NotInvertibleError, match="mixes the batch's"):
        revnet.forward_and_log_det(_gathered(True), x, batch_ndim=1)
