"""Refusals of common shapes end with one ``try:`` line naming the remedy.

Each hint is checked on the program a new user writes first: a residual
``x + f(x)`` (also as a Haiku block in ``ReversibleSequence``), a reduction or a
kink on the stream, an integer or lossy cast, a known singular matrix. Every
message is one line, or one line plus the hint; an unrelated refusal gets no
hint.
"""

from __future__ import annotations

import functools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import revnet
from revnet import blocks
from revnet._engine import errors
from tests.helpers import runtime_checks, tolerance

WHY_TRACED = "checked when a call is traced, before any gradient"


def _lines(error: BaseException) -> list[str]:
    lines = str(error).split("\n")
    assert 1 <= len(lines) <= 2, str(error)
    return lines


def _refusal(fun, x) -> list[str]:
    """The lines of the error of a plain call of ``invertible(fun)``, checked to
    be those of its gradient too."""
    f = revnet.invertible(fun)
    with pytest.raises(revnet.NotInvertibleError) as call:
        f(x)
    with pytest.raises(revnet.NotInvertibleError) as grad:
        jax.grad(lambda x: f(x).astype(jnp.float32).sum())(x)
    assert str(grad.value) == str(call.value)
    return _lines(call.value)


def _assert_hint(lines: list[str], *remedy: str) -> None:
    assert len(lines) == 2, lines
    assert lines[1].startswith("try: "), lines
    for word in remedy:
        assert word in lines[1], lines


# --------------------------------------------------------------------------- #
# A residual x + f(x): split into a coupling.


def _residual_block(h):
    return h + hk.nets.MLP([16, 8])(hk.LayerNorm(-1, True, True)(h))


def test_haiku_residual_block_is_told_to_use_a_coupling():
    model = hk.transform(
        lambda x: blocks.ReversibleSequence(_residual_block, num_layers=2)(x)
    )
    with pytest.raises(revnet.NotInvertibleError) as info:
        model.init(jax.random.PRNGKey(0), jnp.ones([2, 8]))
    first, hint = _lines(info.value)
    assert first.startswith("reversible_sequence is not invertible: "), first
    assert "cannot solve `add` inside `scan`" in first, first
    assert "residual x + f(x)" in first and "test_hints.py" in first, first
    assert WHY_TRACED in first, first
    _assert_hint([first, hint], "revnet.blocks.AdditiveCoupling", "AffineCoupling")
    assert "y1 = x1 + f(x2); y2 = x2 + g(y1)" in hint, hint


def test_the_coupling_the_hint_names_is_accepted():
    def mlp(h):
        return hk.nets.MLP([16, 4])(hk.LayerNorm(-1, True, True)(h))

    model = hk.transform(
        lambda x: blocks.ReversibleSequence(
            lambda h: blocks.AdditiveCoupling(mlp, mlp)(h), num_layers=2
        )(x)
    )
    x = jnp.ones([2, 8])
    params = model.init(jax.random.PRNGKey(0), x)
    grads = jax.grad(lambda p: model.apply(p, None, x).sum())(params)
    assert all(np.isfinite(g).all() for g in jax.tree_util.tree_leaves(grads))


@pytest.mark.parametrize(
    "fun,op",
    [
        (lambda x: x + jnp.tanh(x), "x + f(x)"),
        (lambda x: jnp.sum(x, -1, keepdims=True) + x, "x + f(x)"),
        (lambda x: x * jax.nn.sigmoid(x), "x * f(x)"),
    ],
    ids=["x + tanh(x)", "sum(x) + x", "x * sigmoid(x)"],
)
def test_residual_is_told_to_use_a_coupling(fun, op):
    first, hint = _refusal(fun, jnp.ones([2, 4]))
    assert "cannot solve `" in first and f"residual {op}" in first, first
    assert WHY_TRACED in first, first
    _assert_hint([first, hint], "AdditiveCoupling")


# --------------------------------------------------------------------------- #
# A reduction, relu or max on the stream: only inside F or G.


@pytest.mark.parametrize(
    "fun,prim",
    [
        (lambda x: jax.nn.relu(x), "`max` inside `custom_jvp_call` (relu)"),
        (lambda x: jnp.maximum(x, 0.0), "`max`"),
        (lambda x: x.sum(), "`reduce_sum`"),
    ],
    ids=["relu", "maximum", "sum"],
)
def test_lossy_function_on_the_stream_is_told_to_go_inside_f_or_g(fun, prim):
    first, hint = _refusal(fun, jnp.ones([2, 4]))
    assert f"cannot solve {prim} at " in first, first
    assert "loses information" in first, first
    _assert_hint([first, hint], "inside a coupling's F or G", "AdditiveCoupling")


# --------------------------------------------------------------------------- #
# An integer or lossy cast: keep the stream's dtype, cast inside F or G.


@pytest.mark.parametrize(
    "dtype,reason",
    [(jnp.int32, "float32 to int32"), (jnp.float16, "float32 to float16 rounds")],
    ids=["int32", "float16"],
)
def test_cast_is_told_to_keep_the_stream_dtype(dtype, reason):
    first, hint = _refusal(lambda x: x.astype(dtype), jnp.ones([2, 4]))
    assert "cannot solve `convert_element_type`" in first and reason in first, first
    _assert_hint([first, hint], "floating dtype", "compute_dtype=")


# --------------------------------------------------------------------------- #
# A known singular matrix: use an invertible one.


def test_singular_matrix_folded_at_trace_time_is_told_to_use_an_invertible_one():
    first, hint = _refusal(lambda x: x @ jnp.zeros((4, 4)), jnp.ones([2, 4]))
    assert "cannot solve `dot_general`" in first and "singular" in first, first
    _assert_hint([first, hint], "invertible matrix", "F or G")


def test_singular_constant_matrix_is_told_at_run_time():
    # A constant array (not folded from literals) is checked when the backward
    # pass rebuilds the input: the run-time check reports it, with the hint.
    f = revnet.invertible(lambda x: x @ jnp.array([[1.0, 1.0], [1.0, 1.0]]))
    with runtime_checks(True), pytest.raises(revnet.NotInvertibleError) as info:
        jax.block_until_ready(jax.grad(lambda x: f(x).sum())(jnp.ones([3, 2])))
    first, hint = _lines(info.value)
    assert "`dot_general`" in first and "singular" in first, first
    _assert_hint([first, hint], "invertible matrix")


# --------------------------------------------------------------------------- #
# No wrong hint; the inverse says nothing about traced calls.


@pytest.mark.parametrize(
    "fun,args,reason",
    [
        (lambda x, y: jnp.concatenate([x, y])[:3], 2, "`slice` has no inverse"),
        (lambda x: x * x, 1, "used more than once"),
        (lambda x: x**2, 1, "even power"),
        (jnp.cumprod, 1, "`cumprod` has no inverse rule"),
        (lambda x: x[:, :1], 1, "`slice` has no inverse rule"),
    ],
    ids=["two args, dropped", "x * x", "x ** 2", "cumprod", "dropped slice"],
)
def test_unrelated_refusal_gets_no_hint(fun, args, reason):
    x = jnp.ones([2, 4])
    with pytest.raises(revnet.NotInvertibleError) as info:
        revnet.invertible(fun)(*[x] * args)
    (line,) = _lines(info.value)
    assert reason in line and "residual" not in line and WHY_TRACED in line, line


def test_an_argument_the_outputs_cannot_give_gets_the_known_argnums_hint():
    # a + b: two operands unknown, and b = out - a once a is given (weights,
    # conditioning): the hint names known_argnums and closing over.
    with pytest.raises(revnet.NotInvertibleError) as info:
        revnet.invertible(lambda a, b: a + b)(jnp.ones([2, 4]), jnp.ones([2, 4]))
    first, hint = _lines(info.value)
    assert "2 operands are unknown" in first and WHY_TRACED in first, first
    _assert_hint([first, hint], "known_argnums=0", "args[0]", "close over it")


def test_inverse_keeps_the_hint_without_the_traced_call_clause():
    with pytest.raises(revnet.NotInvertibleError) as info:
        revnet.inverse(lambda x: x + jnp.tanh(x), jnp.ones([2, 4]))
    first, hint = _lines(info.value)
    assert "residual x + f(x)" in first and WHY_TRACED not in first, first
    _assert_hint([first, hint], "AdditiveCoupling")


def test_every_hint_is_one_try_line():
    for kind, hint in errors.HINTS.items():
        assert hint.startswith("try: ") and "\n" not in hint, kind
    with pytest.raises(ValueError, match="unknown hint 'other'"):
        errors.refusal("a reason", hint="other")


# --------------------------------------------------------------------------- #
# Time-steppers: a library's periodic wrap, a leaf the step overwrites.

_PACKAGE = """
import jax
import jax.numpy as jnp


@jax.jit
def periodic_shift(x, dx):
    return jnp.remainder(x + dx, 4.0)


def free_shift(x, dx):
    return x + dx
"""


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A module of a package installed in a ``site-packages`` folder (as
    jax-md's ``space``)."""
    import importlib
    import sys

    site = tmp_path / "site-packages"
    (site / "simpkg").mkdir(parents=True)
    (site / "simpkg" / "__init__.py").write_text("")
    (site / "simpkg" / "space.py").write_text(_PACKAGE)
    monkeypatch.syspath_prepend(str(site))
    yield importlib.import_module("simpkg.space")
    sys.modules.pop("simpkg.space", None)
    sys.modules.pop("simpkg", None)


def _drift_loss(shift, steps=5, scan=None):
    def loss(x, v):
        def step(c, _):
            x, v = c
            v = v - 0.1 * jnp.sin(x)
            return (shift(x, 0.1 * v), v), None

        if scan is None:  # revnet's, inverting
            (x, v), _ = revnet.scan(step, (x, v), None, length=steps, mode="invert")
        else:
            (x, v), _ = scan(step, (x, v), None, length=steps)
        return jnp.sum(jnp.cos(x)) + jnp.sum(v * v)

    return loss


def test_a_periodic_wrap_in_a_library_names_its_line_and_the_users(package):
    x, v = jnp.linspace(0.5, 3.0, 4), jnp.ones(4)
    with pytest.raises(revnet.NotInvertibleError) as info:
        jax.grad(_drift_loss(package.periodic_shift))(x, v)
    first, hint = _lines(info.value)
    at = f"cannot solve `rem` at {package.__file__}:8 (periodic_shift), called from "
    assert f"{at}{__file__}:" in first, first
    _assert_hint([first, hint], "unwrapped coordinates", "free()")
    # Followed: the unwrapped step inverts, with plain autodiff's gradients.
    got = jax.grad(_drift_loss(package.free_shift), (0, 1))(x, v)
    want = jax.grad(_drift_loss(package.free_shift, scan=jax.lax.scan), (0, 1))(x, v)
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(want), rtol=tolerance("float32")
    )


def _lagged(force, dt=0.05):
    def step(state, _):
        x, v, f = state  # f: a force carried from the last step
        v = v + 0.5 * dt * f
        f = force(x)  # overwritten, from the old positions (not derived)
        x = x + dt * v
        return (x, v + 0.5 * dt * f, f), None

    return step


def test_a_leaf_the_step_overwrites_is_named_and_the_rewrite_inverts():
    def force(x):
        return -jnp.sin(x)

    x0 = jnp.linspace(-1.0, 1.0, 3)
    state = (x0, jnp.zeros(3), force(x0))
    with pytest.raises(revnet.NotInvertibleError) as info:
        revnet.scan(_lagged(force), state, None, length=4, mode="invert")
    first, hint = _lines(info.value)
    _assert_hint([first, hint], "overwrites input init[2]", "start of the step")
    assert "init[0]" not in hint and "init[1]" not in hint, hint

    # Followed: the force is computed at the start of the step, not carried.
    def rewritten(state, _):
        x, v = state
        v = v + 0.5 * 0.05 * force(x)
        x = x + 0.05 * v
        return (x, v + 0.5 * 0.05 * force(x)), None

    def loss(scan, x, v):
        (x, v), _ = scan(rewritten, (x, v), None, length=4)
        return jnp.sum(x * x) + jnp.sum(jnp.sin(v))

    def inverted(*a, **k):
        return revnet.scan(*a, **k, mode="invert")

    got = jax.grad(functools.partial(loss, inverted), (0, 1))(x0, x0)
    want = jax.grad(functools.partial(loss, jax.lax.scan), (0, 1))(x0, x0)
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(want), rtol=tolerance("float32")
    )


def test_a_damped_step_that_overflows_names_damping_with_run_time_checks():
    """A loop step that multiplies part of its carry by 1e-3 is undone by
    dividing by it at every reversed step, until the rebuilt values overflow;
    the run-time check's message names that cause and what to do."""

    def step(c, w):
        a, b = c
        a = a + jnp.tanh(b * w)
        return (a, 1e-3 * b + a), None

    def loss(w, x):
        (a, b), _ = revnet.scan(step, (x, x), w, mode="invert")
        return jnp.sum(a**2 + b**2)

    with runtime_checks(True), pytest.raises(revnet.NotInvertibleError) as info:
        jax.grad(loss)(jnp.full((40,), 0.3), jnp.ones(4))
    message = str(info.value)
    assert "\n" not in message
    assert "the inverse of `mul`" in message and "<locals>.step)" in message, message
    assert "damping factor of modulus below 1" in message, message
    assert "mode='checkpoint'" in message, message


# --------------------------------------------------------------------------- #
# A normalisation by batch statistics on the stream: inside F or G, or ActNorm.

_STATISTIC = "a statistic of the stream"


def _assert_statistic(error: BaseException | list[str]) -> None:
    first, hint = error if isinstance(error, list) else _lines(error)
    assert "is not invertible: cannot solve `" in first, first
    assert _STATISTIC in first and "test_hints.py" in first, first
    assert "optimization_barrier" not in first, first
    _assert_hint([first, hint], "inside a coupling's F or G", "ActNorm")


@pytest.mark.parametrize(
    "fun",
    [
        lambda x: (x - jnp.mean(x, 0)) * jax.lax.rsqrt(jnp.var(x, 0) + 1e-5),
        lambda x: (x - jnp.mean(x, -1, keepdims=True)) / jnp.std(x, -1, keepdims=True),
    ],
    ids=["batch norm", "layer norm"],
)
def test_normalisation_on_the_stream_names_its_statistic(fun):
    _assert_statistic(_refusal(fun, _ramp()))


def _ramp():
    return jnp.arange(12.0).reshape(3, 4) / 7.0


def test_haiku_batch_norm_on_the_stream_names_its_statistic():
    """hk.BatchNorm in training mode as a block: the refusal names the block's
    line and the batch statistic, not the barrier revnet puts behind a
    layer's new state."""

    def block(h):
        return hk.BatchNorm(True, True, 0.9)(h, is_training=True)

    model = hk.transform_with_state(
        lambda x: blocks.ReversibleSequence(block, num_layers=2)(x)
    )
    with pytest.raises(revnet.NotInvertibleError) as info:
        model.init(jax.random.PRNGKey(0), _ramp())
    _assert_statistic(info.value)


def test_nnx_and_equinox_batch_norm_on_the_stream_names_its_statistic():
    nnx = pytest.importorskip("flax.nnx")
    eqx = pytest.importorskip("equinox")
    import revnet.eqx
    import revnet.nnx

    class NnxBlock(nnx.Module):
        def __init__(self, rngs):
            self.bn = nnx.BatchNorm(4, rngs=rngs)

        def __call__(self, h):
            return self.bn(h)

    seq = revnet.nnx.ReversibleSequence(
        lambda rngs: NnxBlock(rngs), 2, rngs=nnx.Rngs(0)
    )
    with pytest.raises(revnet.NotInvertibleError) as info:
        seq(_ramp())
    _assert_statistic(info.value)

    class EqxBlock(eqx.Module):
        bn: eqx.nn.BatchNorm

        def __init__(self, key):
            self.bn = eqx.nn.BatchNorm(4, axis_name="batch", mode="batch")

        def __call__(self, h, state, *, key=None):
            return self.bn(h, state)

    make = eqx.nn.make_with_state(revnet.eqx.ReversibleSequence)
    seq, state = make(EqxBlock, 2, key=jax.random.key(0), axis_name="batch")
    with pytest.raises(revnet.NotInvertibleError) as info:
        seq(_ramp(), state)
    _assert_statistic(info.value)
