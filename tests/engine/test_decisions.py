"""Decisions are stored, not made again on rebuilt values (_engine/decisions.py)."""

from __future__ import annotations

import functools
import warnings

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import revnet
from benchmarks import decisions as bd
from revnet import blocks
from revnet._engine import expose, stored_bytes, trace
from revnet._engine.loops.hooks import modes_chosen
from tests.helpers import assert_trees_close, tolerance

PROGRAMS = list(bd.PROGRAMS)


def _grads(decide, wrap, dtype, depth=32):
    ps, (a, b) = bd.params(depth, dtype), bd.inputs(dtype)
    return jax.jit(jax.grad(bd.loss_fn(decide, wrap), (0, 1, 2)))(ps, a, b)


@pytest.mark.parametrize("name", PROGRAMS)
@pytest.mark.slow
def test_decision_programs_match_jax_grad_at_depth_32(name):
    """The six decision programs, float32, tied inputs: every input and
    parameter leaf within 1e-3 of its largest entry (measured: <= 4e-6)."""
    decide = bd.PROGRAMS[name]
    want = _grads(decide, None, jnp.float32)
    got = _grads(decide, revnet.invertible, jnp.float32)
    errors = bd.leaf_errors(got, want)
    assert len(errors) == 6  # the four parameter leaves, a and b
    assert max(errors) <= tolerance(jnp.float32, "decision_cases"), errors
    # decisions="recompute" still runs (and may differ near a tie).
    wrap = functools.partial(revnet.invertible, decisions="recompute")
    again = _grads(decide, wrap, jnp.float32)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(again))


@pytest.mark.parametrize("name", PROGRAMS)
@pytest.mark.slow
def test_decision_programs_match_jax_grad_in_float64(name):
    decide = bd.PROGRAMS[name]
    with jax.enable_x64(True):
        want = _grads(decide, None, jnp.float64, depth=8)
        got = _grads(decide, revnet.invertible, jnp.float64, depth=8)
        assert_trees_close(got, want, tolerance(jnp.float64), "float64 gradients")


def test_routing_decisions_flip_when_recomputed():
    """The test above can fail: recomputed routing on rebuilt values follows
    other experts on these inputs (one-hot dispatch: 30% of the largest entry),
    and storing the decision is what makes the gradient right."""
    decide = bd.PROGRAMS["one-hot dispatch"]
    want = _grads(decide, None, jnp.float32)
    wrap = functools.partial(revnet.invertible, decisions="recompute")
    assert max(bd.leaf_errors(_grads(decide, wrap, jnp.float32), want)) > 1e-2  # wrong


# -- what is stored ---------------------------------------------------------- #


def _temp(decide, depth, mode):
    ps, (a, b) = bd.params(depth), bd.inputs()
    wrap = functools.partial(revnet.invertible, decisions=mode)
    step = jax.jit(jax.grad(bd.loss_fn(decide, wrap), (1, 2)))
    return bd.temp_bytes(step, ps, a, b)


# Bytes stored per layer: two couplings, one decision tensor each.
PER_LAYER = {
    "b > 0": 2 * bd.BATCH * bd.WIDTH,  # bool
    "sign": 2 * bd.BATCH * bd.WIDTH,  # int8
    "argmax routing": 2 * bd.BATCH * 4,  # int32 per token
}


@pytest.mark.parametrize("name", list(PER_LAYER))
@pytest.mark.slow
def test_a_stack_with_decisions_stores_exactly_its_decision_tensors(name):
    decide = bd.PROGRAMS[name]
    stored = [_temp(decide, depth, "store") for depth in (4, 32)]
    # Flat in depth but for the decisions: 28 more layers, 28 more tensors.
    assert stored[1] - stored[0] == 28 * PER_LAYER[name]
    # Recomputing stores nothing: flat to the byte.
    recomputed = [_temp(decide, depth, "recompute") for depth in (4, 32)]
    assert recomputed[0] == recomputed[1]


def test_exposed_decisions_are_the_stored_bytes():
    ps, (a, b) = bd.params(6), bd.inputs()
    f = bd.stack(bd.PROGRAMS["argmax routing"], ps)
    jaxpr, consts, _ = trace(f, [a, b])
    exposed = expose(jaxpr, [False] * len(consts) + [True, True])
    assert exposed.n == 2  # one stacked [depth, batch] routing per coupling
    assert stored_bytes(exposed) == 2 * 6 * bd.BATCH * 4


def test_a_stack_without_decisions_is_unchanged():
    """No decision: the very same jaxpr, and the same compiled program."""
    ps, (a, b) = bd.params(4), bd.inputs()

    def smooth(h, p):
        return jnp.tanh(h)

    f = bd.stack(smooth, ps)
    jaxpr, consts, _ = trace(f, [a, b])
    assert expose(jaxpr, [False] * len(consts) + [True, True]).jaxpr is jaxpr
    assert _temp(smooth, 4, "store") == _temp(smooth, 4, "recompute")
    assert _temp(smooth, 32, "store") == _temp(smooth, 4, "store")


def test_decisions_on_constants_are_recomputed():
    """A comparison of weights or a counter cannot flip: nothing is stored."""
    w = jnp.linspace(-1.0, 1.0, 8)

    def f(a, b):
        a = a + jnp.where(w > 0, jnp.tanh(b), b * 0.5)
        return a, b

    a = jnp.ones((2, 8))
    jaxpr, consts, _ = trace(f, [a, a])
    assert expose(jaxpr, [False] * len(consts) + [True, True]).n == 0


def test_inverted_path_with_a_stored_predicate():
    """A stored predicate makes a piecewise-linear map of the stream invertible."""

    def f(x):
        return jnp.where(x > 0, 2.0 * x, 0.5 * x)

    x = jnp.array([-1.0, 0.0, 0.5, 2.0])
    g = jax.grad(lambda x: jnp.sum(jnp.sin(revnet.invertible(f)(x))))(x)
    want = jax.grad(lambda x: jnp.sum(jnp.sin(f(x))))(x)
    assert_trees_close(g, want, tolerance(jnp.float32, "values"))  # one multiplication


def test_bad_decisions_options_are_refused():
    with pytest.raises(ValueError, match="decisions must be one of"):
        revnet.invertible(lambda x: x, decisions="always")
    with pytest.raises(ValueError, match="kinks must be one of"):
        revnet.scan(lambda c, x: (c, x), 0.0, length=2, kinks="yes")
    with pytest.raises(ValueError, match="decisions must be one of"):
        hk.transform(
            lambda x: blocks.ReversibleSequence(
                lambda h: h, num_layers=2, decisions=None
            )(x)
        ).init(jax.random.key(0), jnp.ones((2, 4)))


# -- kinks ------------------------------------------------------------------- #

KINKS = {
    "relu": lambda h: jax.nn.relu(h),
    "max": lambda h: jnp.maximum(h, 0.25),
    "min": lambda h: jnp.minimum(h, -0.25),
    "abs": lambda h: jnp.abs(h) * 0.5,
    "clip": lambda h: jnp.clip(h, -0.5, 0.5),
}


@pytest.mark.parametrize("name", list(KINKS))
@pytest.mark.slow
def test_stored_kinks_differentiate_as_jax_grad_at_exact_ties(name):
    """Kinks at exact ties in the forward pass (halves against 0, +-1/4, 1/2)."""
    kink = KINKS[name]

    def f(a, b):
        for _ in range(3):
            a = a + kink(b) + 0.5 * jnp.tanh(b)
            b = b + kink(a) + 0.5 * jnp.tanh(a)
        return a, b

    a = jnp.array([[0.0, 0.25, -0.25, 0.5, -0.5, 1.0]])
    b = jnp.array([[0.25, 0.0, 0.5, -0.25, -0.5, -1.0]])

    def loss(fn):
        return lambda a, b: sum(jnp.sum(jnp.sin(o) * (1.0 + o)) for o in fn(a, b))

    want = jax.grad(loss(f), (0, 1))(a, b)
    got = jax.grad(loss(revnet.invertible(f, kinks="store")), (0, 1))(a, b)
    assert_trees_close(got, want, tolerance(jnp.float32), f"{name} gradients")
    with jax.enable_x64(True):
        a64, b64 = a.astype(jnp.float64), b.astype(jnp.float64)
        want = jax.grad(loss(f), (0, 1))(a64, b64)
        got = jax.grad(loss(revnet.invertible(f, kinks="store")), (0, 1))(a64, b64)
        rtol = 1e-12  # float64, six couplings at ties: tighter than the table
        assert_trees_close(got, want, rtol, f"{name} gradients, float64")


def test_stored_kinks_cost_one_small_tensor_each():
    def f(a, b):
        a = a + jax.nn.relu(b)
        b = b + jnp.maximum(a, 0.0)
        return a, b

    x = jnp.ones((4, 8))
    jaxpr, consts, _ = trace(f, [x, x])
    rebuilt = [False] * len(consts) + [True, True]
    assert expose(jaxpr, rebuilt).n == 0  # recomputed by default
    exposed = expose(jaxpr, rebuilt, kinks="store")
    assert exposed.n == 2
    assert stored_bytes(exposed) == 32 + 32  # bool (relu) and int8 (max)


# -- loops ------------------------------------------------------------------- #


def _routing_body(c, w):
    a, b = c
    a = a + jax.nn.one_hot(jnp.argmax(b @ w[0], -1), b.shape[-1]) * jnp.tanh(b)
    b = b + jax.nn.one_hot(jnp.argmax(a @ w[1], -1), a.shape[-1]) * jnp.tanh(a)
    return (a, b), jnp.sum(b)


@pytest.mark.parametrize(
    "kw", [{}, {"anchor_every": 4}, {"mode": "invert"}, {"mode": "checkpoint"}]
)
@pytest.mark.slow
def test_revnet_scan_stores_decisions_per_step(kw):
    ps, (a, b) = bd.params(24), bd.inputs()
    ws = jnp.stack([ps["f"], ps["g"]], 1)

    def loss(scan):
        def run(a, b, ws):
            (a, b), ys = scan(_routing_body, (a, b), ws)
            return jnp.sum(jnp.sin(a)) + jnp.sum(jnp.cos(b)) + jnp.sum(ys)

        return jax.jit(jax.grad(run, (0, 1, 2)))

    want = loss(jax.lax.scan)(a, b, ws)
    got = loss(functools.partial(revnet.scan, **kw))(a, b, ws)
    assert max(bd.leaf_errors(got, want)) <= tolerance(jnp.float32)


def test_while_loop_stores_decisions_per_step_within_max_steps():
    """With max_steps a while loop stores its decisions per step, as a scan
    does, in every mode; without it, it checkpoints them (exact), and refuses
    mode='invert' naming the deciding equation."""
    ps, (a, b) = bd.params(12), bd.inputs()
    ws = jnp.stack([ps["f"], ps["g"]], 1)

    def body(c):
        i, a, b = c
        (a, b), _ = _routing_body((a, b), ws[i])
        return i + 1, a, b

    def run(a, b, **kw):
        out = revnet.while_loop(lambda c: c[0] < 12, body, (0, a, b), **kw)
        return jnp.sum(jnp.sin(out[1])) + jnp.sum(out[2])

    def plain(a, b):
        c = (0, a, b)
        for _ in range(12):
            c = body(c)
        return jnp.sum(jnp.sin(c[1])) + jnp.sum(c[2])

    want = jax.grad(plain, (0, 1))(a, b)
    kinds = {"auto": "invert", "invert": "invert", "store": "invert"}
    kinds["checkpoint"] = "checkpoint"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", revnet.StoredGrowthWarning)
        for mode, kind in kinds.items():
            with modes_chosen() as seen:
                ours = functools.partial(run, mode=mode, max_steps=12)
                got = jax.jit(jax.grad(ours, (0, 1)))(a, b)
            assert [m.kind for m in seen] == [kind], mode
            assert max(bd.leaf_errors(got, want)) <= tolerance(jnp.float32), mode
    # Without max_steps: checkpointed, the same exact gradient.
    with modes_chosen() as seen:
        got = jax.jit(jax.grad(run, (0, 1)))(a, b)
    assert [m.kind for m in seen] == ["checkpoint"]
    assert max(bd.leaf_errors(got, want)) <= tolerance(jnp.float32)
    words = r"while_loop: a decision \(`argmax` at .*test_decisions\.py.*max_steps"
    with pytest.raises(ValueError, match=words):
        run(a, b, mode="invert")


# -- an MoE-routed reversible transformer block (Haiku) ---------------------- #

EXPERTS, TOP_K = 4, 2


def _moe_block(h):
    """Attention in F, a top-2 routed mixture of experts in G."""
    d = h.shape[-1] // 2

    def attention(x):
        x = hk.LayerNorm(-1, True, True)(x)
        return hk.MultiHeadAttention(
            2, d // 2, w_init=hk.initializers.VarianceScaling()
        )(x, x, x)

    def moe(x):
        x = hk.LayerNorm(-1, True, True)(x)
        logits = hk.Linear(EXPERTS, name="router")(x)
        gates, idx = jax.lax.top_k(logits, TOP_K)
        gates = jax.nn.softmax(gates, -1)
        dispatch = jax.nn.one_hot(idx, EXPERTS, dtype=x.dtype)  # [b, t, k, e]
        w = hk.get_parameter(
            "experts", [EXPERTS, d, d], init=hk.initializers.VarianceScaling()
        )
        per_expert = jnp.einsum("btd,edf->btef", x, w)
        return jnp.einsum("btke,btk,btef->btf", dispatch, gates, jnp.tanh(per_expert))

    return blocks.AdditiveCoupling(attention, moe)(h)


def _moe_model(reversible, decisions="store", depth=4):
    def fwd(x):
        seq = blocks.ReversibleSequence(
            _moe_block, depth, reversible=reversible, decisions=decisions
        )
        return jnp.sum(jnp.sin(seq(x)))

    return hk.without_apply_rng(hk.transform(fwd))


def _tied_tokens(batch=4, time=6, width=16):
    # Tokens repeat (padding, duplicates): equal router logits and exact ties.
    rng = np.random.default_rng(3)
    base = np.round(rng.normal(size=(batch, 2, width)) * 2) / 2
    return jnp.asarray(np.repeat(base, time // 2, axis=1), jnp.float32)


@pytest.mark.slow
def test_moe_routed_reversible_transformer_matches_its_twin():
    x = _tied_tokens()
    model, twin = _moe_model(True), _moe_model(False)
    params = jax.jit(model.init)(jax.random.key(0), x)
    want = jax.jit(jax.grad(twin.apply, (0, 1)))(params, x)
    got = jax.jit(jax.grad(model.apply, (0, 1)))(params, x)
    rtol = 1e-4  # float32, top-k routing and softmax at ties: looser than the table
    assert_trees_close(got, want, rtol, "MoE gradients")
    with jax.enable_x64(True):
        x64 = x.astype(jnp.float64)
        p64 = jax.tree.map(lambda v: v.astype(jnp.float64), params)
        want = jax.grad(twin.apply, (0, 1))(p64, x64)
        got = jax.grad(model.apply, (0, 1))(p64, x64)
        assert_trees_close(got, want, tolerance(jnp.float64), "MoE gradients, float64")


@pytest.mark.slow
def test_moe_stores_one_routing_per_token_and_layer():
    """Memory cost: top-2 indices, int32, per token and layer (plus nothing)."""
    x = _tied_tokens()
    temps = {}
    for depth in (4, 12):
        for mode in ("store", "recompute"):
            model = _moe_model(True, mode, depth)
            params = jax.jit(model.init)(jax.random.key(0), x)
            step = jax.jit(jax.grad(model.apply))
            temps[depth, mode] = bd.temp_bytes(step, params, x)
    tokens = x.shape[0] * x.shape[1]
    per_layer = tokens * TOP_K * 4
    assert temps[12, "store"] - temps[4, "store"] == 8 * per_layer
    assert temps[12, "recompute"] == temps[4, "recompute"]


@pytest.mark.slow
def test_a_decision_inside_shard_map_is_refused_not_recomputed():
    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = jax.sharding.PartitionSpec("x")

    def coupling(a, b):
        a = a + jnp.where(b > 0, jnp.tanh(b), 0.5 * b)
        b = b + jnp.tanh(a)
        return a, b

    f = jax.shard_map(coupling, mesh=mesh, in_specs=(spec, spec), out_specs=spec)
    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    with pytest.raises(ValueError, match=r"decision \(`gt` at .*inside a shard_map"):
        jax.grad(lambda a: jnp.sum(revnet.invertible(f)(a, x)[0]))(x)
    g = jax.grad(
        lambda a: jnp.sum(revnet.invertible(f, decisions="recompute")(a, x)[0])
    )(x)
    want = jax.grad(lambda a: jnp.sum(f(a, x)[0]))(x)
    assert_trees_close(g, want, 1e-6)  # two couplings: tighter than the table


def test_a_rewritten_decision_can_be_an_output():
    """top_k values, a sort and a stored kink returned as they are."""
    w = jnp.linspace(-1.0, 1.0, 16).reshape(4, 4)

    def f(a, b):
        a = a + jnp.sort(jnp.tanh(b @ w), -1)
        b = b + jax.lax.top_k(a, 4)[0] * 0.5
        return a, b, jnp.maximum(b, 0.0)

    a = jnp.array([[0.0, 0.5, -0.5, 0.5]])
    b = jnp.array([[0.25, 0.0, 0.25, -0.5]])
    inv = revnet.invertible(f, kinks="store")
    for got, want in zip(inv(a, b), f(a, b)):
        np.testing.assert_array_equal(got, want)

    def loss(fn):
        return lambda a, b: sum(jnp.sum(jnp.sin(o) * (1.0 + o)) for o in fn(a, b))

    want = jax.grad(loss(f), (0, 1))(a, b)
    assert_trees_close(jax.grad(loss(inv), (0, 1))(a, b), want, tolerance(jnp.float32))
