"""The cross-door table: every front door (Haiku, Equinox, Flax NNX).

Each door (``tests/doors/adapters/<name>.py``) builds a stack of its framework's own
additive-coupling blocks with a BatchNorm and dropout in F and G, through its
public front door. Every row compares the reversible stack with the door's own
non-reversible twin on the same parameters: gradients per leaf (parameters and
input) in float32 and float64, the new BatchNorm statistics, dropout replayed
with the same key, compiled temporary memory flat in depth, anchors and the
drift monitor. The features every door offers run through each door too:
``compute_dtype`` (the couplings compute in it, the stream keeps its dtype,
memory stays flat), lists of different blocks, the reversible transformer
block and the one-line refusals of bad input, and the exact mode
(``AdditiveCoupling(..., exact=True)``: the stack rebuilt bit for bit, its
gradients those of its twin bit for bit); ``activation_sharding`` runs on
an 8-device mesh in ``tests/sharding/test_doors.py``. A door whose framework
is not installed skips with the extra to install.
"""

from __future__ import annotations

import functools
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import revnet
from tests.helpers import (
    assert_trees_close,
    compiled,
    equations,
    runtime_checks,
    temp_size,
    tolerance,
)

DOORS = ["haiku", "equinox", "nnx"]

F64 = pytest.param(jnp.float64, id="f64", marks=pytest.mark.slow)
BF16 = jnp.bfloat16
KEY = jax.random.PRNGKey(1)
DTYPES = [pytest.param(jnp.float32, id="f32"), F64]


def load(name):
    """The door module (skips, naming the extra, if its framework is missing)."""
    return importlib.import_module(f"tests.doors.adapters.{name}")


@pytest.fixture(params=DOORS)
def door(request):
    return request.param


def loss_fn(apply):
    def loss(params, state, x, key):
        y, new_state = apply(params, state, x, key)
        return jnp.sum(jnp.sin(y)), (y, new_state)

    return loss


def train_step(built, key=1):
    """Loss, output, new state and gradients (params, x) of one step."""
    grad = jax.jit(jax.value_and_grad(loss_fn(built.apply), (0, 2), has_aux=True))
    (value, (y, new_state)), grads = grad(
        built.params, built.state, built.x, jax.random.PRNGKey(key)
    )
    return dict(built=built, loss=value, y=y, state=new_state, grads=grads)


def assert_equals_twin(rev, std, rtol, what):
    assert_trees_close(rev["y"], std["y"], rtol, f"{what}: output")
    assert_trees_close(rev["grads"][0], std["grads"][0], rtol, f"{what}: params")
    assert_trees_close(rev["grads"][1], std["grads"][1], rtol, f"{what}: input")


@functools.cache
def run(name, dtype, depth=3, anchor_every=None, key=1):
    """Loss, output, new state and gradients (params, x) of the reversible
    stack and of its twin, with a dropout key; and the initial state."""
    door = load(name)
    out = {}
    for reversible in (True, False):
        built = door.build(
            depth, dtype=dtype, reversible=reversible, anchor_every=anchor_every
        )
        out[reversible] = train_step(built, key)
    return out[True], out[False]


def x64(dtype):
    return jax.enable_x64(jnp.dtype(dtype) == jnp.float64)


def test_the_twin_has_the_same_parameters_and_state(door):
    rev, std = (
        load(door).build(3, dtype=jnp.float32, reversible=r) for r in (True, False)
    )
    for a, b in ((rev.params, std.params), (rev.state, std.state), (rev.x, std.x)):
        assert jax.tree.structure(a) == jax.tree.structure(b)
        jax.tree.map(np.testing.assert_array_equal, a, b)
    assert len(jax.tree.leaves(rev.params)) >= 8  # linear and BatchNorm, F and G


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_equal_the_twin_per_leaf(door, dtype):
    with x64(dtype):
        rev, std = run(door, dtype)
        rtol = tolerance(dtype, loops=True)
        assert jnp.result_type(rev["y"]) == jnp.dtype(dtype)
        assert_trees_close(rev["y"], std["y"], rtol, "output")
        assert_trees_close(rev["grads"][0], std["grads"][0], rtol, "params grads")
        assert_trees_close(rev["grads"][1], std["grads"][1], rtol, "input grads")


@pytest.mark.parametrize("dtype", DTYPES)
def test_batchnorm_statistics_equal_the_twin(door, dtype):
    with x64(dtype):
        rev, std = run(door, dtype)
        assert_trees_close(rev["state"], std["state"], tolerance(dtype), "state")
        # The statistics really moved: the row could fail.
        initial = rev["built"].state
        moved = [
            not np.allclose(a, b)
            for a, b in zip(jax.tree.leaves(rev["state"]), jax.tree.leaves(initial))
            if jnp.issubdtype(jnp.result_type(a), jnp.floating)
        ]
        assert moved and all(moved), moved


def test_dropout_is_replayed_with_the_same_key(door):
    rev, std = run(door, jnp.float32)
    other, other_std = run(door, jnp.float32, key=2)
    # Same key: the twin's output and gradients, for two keys; the two keys
    # give two masks, so the comparison is not vacuous.
    rtol = tolerance(jnp.float32, loops=True)
    assert_trees_close(rev["y"], std["y"], rtol, "output")
    assert_trees_close(other["y"], other_std["y"], rtol, "output, key 2")
    assert_trees_close(other["grads"], other_std["grads"], rtol, "grads, key 2")
    assert not np.allclose(rev["y"], other["y"], atol=1e-3)  # two masks: far apart


def train_step_temp(name, depth, reversible, exact=False):
    built = load(name).build(
        depth, dtype=jnp.float32, reversible=reversible, exact=exact
    )
    grad = jax.grad(loss_fn(built.apply), (0, 2), has_aux=True)
    with runtime_checks(False):  # measure the library's default
        program = compiled(
            grad, built.params, built.state, built.x, jax.random.PRNGKey(1)
        )
    return temp_size(program)


@pytest.mark.slow
def test_temporary_memory_is_flat_in_depth(door):
    rev = {d: train_step_temp(door, d, True) for d in (4, 32)}
    std = train_step_temp(door, 32, False)
    print(f"{door}: reversible {rev}, twin at 32 {std}")
    assert rev[32] <= 1.1 * rev[4], rev
    assert 4 * rev[32] <= std, (rev, std)


@pytest.mark.slow
def test_anchors_equal_the_twin_and_report_drift(door):
    monitor = revnet.DriftMonitor()
    built = {
        r: load(door).build(
            8,
            dtype=jnp.float32,
            reversible=r,
            anchor_every=4,
            drift=monitor if r else None,
        )
        for r in (True, False)
    }
    grads = {
        r: jax.jit(jax.grad(loss_fn(b.apply), (0, 2), has_aux=True))(
            b.params, b.state, b.x, jax.random.PRNGKey(1)
        )
        for r, b in built.items()
    }
    rtol = tolerance(jnp.float32, loops=True)
    assert_trees_close(grads[True], grads[False], rtol, "anchored grads")
    jax.effects_barrier()
    assert monitor.latest is not None and monitor.latest.shape == (2,)
    assert np.all(monitor.latest < 1e-4), monitor.latest  # float32 drift readings


# --------------------------------------------------------------------------- #
# The features every door offers.


def dot_dtypes(built):
    """The operand dtypes of the matrix products of the forward pass."""
    eqns = equations(built.apply, built.params, built.state, built.x, KEY)
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    return {str(v.aval.dtype) for e in dots for v in e.invars}


@pytest.mark.parametrize("model", ["build", "build_transformer"])
def test_compute_dtype_runs_the_couplings_in_it(door, model):
    make = getattr(load(door), model)
    steps = {
        r: train_step(make(2, dtype=jnp.float32, reversible=r, compute_dtype=BF16))
        for r in (True, False)
    }
    rev, std = steps[True], steps[False]
    # The couplings' products run in bfloat16 (only there: the stream's
    # arithmetic is float32); the stream and every gradient stay float32.
    assert dot_dtypes(rev["built"]) == {"bfloat16"}, dot_dtypes(rev["built"])
    assert rev["y"].dtype == jnp.float32
    assert {g.dtype for g in jax.tree.leaves(rev["grads"])} == {jnp.dtype("float32")}
    plain = train_step(make(2, dtype=jnp.float32, reversible=False))
    assert not np.allclose(plain["y"], rev["y"], rtol=1e-4, atol=1e-4)  # bfloat16 shows
    # Two programs computing in bfloat16 round where their fusion puts the
    # roundings, so the reversible step and its twin differ by bfloat16
    # rounding (exactly 0 for some doors): per gradient leaf, no more than
    # twice what computing in bfloat16 costs the twin itself.
    rtol = tolerance(jnp.float32, loops=True)
    for n, (r, s, p) in enumerate(
        zip(*(jax.tree.leaves(t["grads"]) for t in (rev, std, plain)))
    ):
        cost = float(jnp.max(jnp.abs(s - p)))
        bound = 2 * cost + rtol * float(jnp.max(jnp.abs(p)))
        assert float(jnp.max(jnp.abs(r - s))) <= bound, (model, n, cost)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["build", "build_transformer"])
def test_compute_dtype_keeps_memory_flat_in_depth(door, model):
    """The narrowing casts into the couplings are not stored per layer."""
    make = getattr(load(door), model)

    def temp(depth):
        built = make(depth, dtype=jnp.float32, reversible=True, compute_dtype=BF16)
        grad = jax.grad(loss_fn(built.apply), (0, 2), has_aux=True)
        with runtime_checks(False):
            return temp_size(
                compiled(
                    grad, built.params, built.state, built.x, jax.random.PRNGKey(1)
                )
            )

    small, deep = temp(2), temp(16)
    assert deep <= 1.1 * small, (small, deep)


def _parameterless(x):
    a, b = jnp.split(x, 2, -1)
    b = b + jnp.tanh(a)
    return jnp.concatenate([a + jnp.sin(b), b], -1)


def _parameterless_stack(name, depth):
    """``(apply, inverse)`` of a door's stack of ``depth`` blocks that hold
    no parameters, state or keys: nothing stacked gives the scan its length."""
    load(name)  # skips without the framework
    if name == "haiku":
        import haiku as hk

        import revnet.blocks as rb

        t = hk.transform(lambda x: rb.ReversibleSequence(_parameterless, depth)(x))
        inv = hk.transform(
            lambda y: rb.ReversibleSequence(_parameterless, depth).inverse(y)
        )
        params = t.init(KEY, jnp.ones([2, 4]))
        return (lambda x: t.apply(params, KEY, x)), (
            lambda y: inv.apply(params, KEY, y)
        )
    if name == "nnx":
        from flax import nnx

        import revnet.nnx as rn

        class Block(nnx.Module):
            def __init__(self, *, rngs):
                del rngs

            def __call__(self, x):
                return _parameterless(x)

        m = rn.ReversibleSequence(Block, depth, rngs=nnx.Rngs(0))
        return m, m.inverse
    import equinox as eqx

    import revnet.eqx as re

    class Block(eqx.Module):
        def __call__(self, x, key=None):
            return _parameterless(x)

    m = re.ReversibleSequence(lambda key: Block(), num_layers=depth, key=KEY)
    return m, m.inverse


@pytest.mark.parametrize("dtype", DTYPES)
def test_blocks_without_parameters_equal_plain_autodiff(door, dtype):
    """A stack of blocks that hold nothing (NNX once failed: no stacked leaf
    told the scan how many layers to run) has plain JAX's gradient and
    inverts."""
    with x64(dtype):
        apply, inverse = _parameterless_stack(door, 3)
        x = jax.random.normal(KEY, (2, 4), dtype)

        def plain(x):
            for _ in range(3):
                x = _parameterless(x)
            return x

        rtol = tolerance(dtype)
        assert_trees_close(apply(x), plain(x), rtol, "output")
        got = jax.grad(lambda x: jnp.sum(jnp.sin(apply(x))))(x)
        want = jax.grad(lambda x: jnp.sum(jnp.sin(plain(x))))(x)
        assert_trees_close(got, want, rtol, "input gradient")
        assert_trees_close(inverse(apply(x)), x, rtol, "inverse")


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_list_of_different_blocks_equals_the_twin(door, dtype):
    with x64(dtype):
        rev, std = (
            train_step(load(door).build_mixed(dtype=dtype, reversible=r))
            for r in (True, False)
        )
        assert len(jax.tree.leaves(rev["built"].params)) > len(
            jax.tree.leaves(load(door).build(1, dtype=dtype, reversible=True).params)
        )
        assert_equals_twin(rev, std, tolerance(dtype, loops=True), "mixed blocks")


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_transformer_block_equals_the_twin(door, dtype):
    with x64(dtype):
        rev, std = (
            train_step(load(door).build_transformer(2, dtype=dtype, reversible=r))
            for r in (True, False)
        )
        assert rev["y"].shape == rev["built"].x.shape
        assert_equals_twin(rev, std, tolerance(dtype, loops=True), "transformer")
        # Dropout is on: another key gives another output.
        other = train_step(rev["built"], key=2)
        assert not np.allclose(rev["y"], other["y"], atol=1e-3)  # two masks


def _error_rows(attribute="ERRORS"):
    rows = []
    for name in DOORS:
        try:
            table = getattr(load(name), attribute)
        except pytest.skip.Exception:
            continue
        rows += [
            pytest.param(name, *row, id=f"{name}-{i}") for i, row in enumerate(table)
        ]
    return rows


@pytest.mark.parametrize("name, make, error, message", _error_rows())
def test_bad_input_is_refused_in_one_line(name, make, error, message):
    with pytest.raises(error, match=message) as info:
        make()
    text = str(info.value)
    assert "\n" not in text.strip(), text
    assert re.match(r"(Reversible|reversible_)\w*[:.]", text), text


# --------------------------------------------------------------------------- #
# Exact mode: every door's AdditiveCoupling(..., exact=True).

EXACT_DEPTH = 64

OPTIMIZED_BATCHNORM = pytest.mark.xfail(
    raises=AssertionError,
    strict=True,
    reason="with LLVM's optimisations, XLA on CPU compiles the BatchNorm of the "
    "reversible backward (recomputed, then differentiated) and of the twin's "
    "backward into code whose last bits differ (op by op, or without them, as "
    "the suite compiles, the gradients are equal bit for bit)",
)
EQUINOX_LAST_BITS = pytest.mark.xfail(
    raises=AssertionError,
    strict=True,
    reason="the Equinox door's exact gradients differ from its twin's in the "
    "last bits (about 4e-7 relative), even as the suite compiles; its stack is "
    "still rebuilt bit for bit. Cause not found yet: unlike the other doors it "
    "vmaps each block over the batch, BatchNorm's statistics a pmean over the "
    "vmapped axis",
)
EXACT_DOORS = DOORS
COUPLING = {"haiku": "additive_coupling", "equinox": "AdditiveCoupling"}


def exact_steps(name, dtype, depth):
    """One train step of the exact reversible stack and of its exact twin."""
    return tuple(
        train_step(load(name).build(depth, dtype=dtype, reversible=r, exact=True))
        for r in (True, False)
    )


def on_grid(x):
    return bool(jnp.all(revnet.exact.grid(x) == x))


def fresh(state):
    """A copy of a door's state (Equinox refuses a state used once already)."""
    leaves, treedef = jax.tree_util.tree_flatten(state)
    return jax.tree_util.tree_unflatten(treedef, leaves)


@pytest.mark.parametrize("name", EXACT_DOORS)
def test_an_exact_stack_is_rebuilt_bit_for_bit(name):
    built = load(name).build(
        EXACT_DEPTH, dtype=jnp.float32, reversible=True, exact=True
    )

    def forward(x):
        return built.apply(built.params, fresh(built.state), x, KEY)[0]

    y = jax.jit(forward)(built.x)
    assert on_grid(y)
    (back,) = jax.jit(revnet.inverse(forward, built.x))(y)
    x = revnet.exact.grid(built.x)
    assert not np.array_equal(x, built.x)  # the rounding is not vacuous
    np.testing.assert_array_equal(back, x)


def _bitwise_rows():
    rows = []
    for name in DOORS:
        for mode in ("suite", "optimized"):
            marks = [pytest.mark.slow]  # two programs of depth 64: 4 to 12 s
            if mode == "optimized":
                marks += [pytest.mark.optimized, OPTIMIZED_BATCHNORM]
            elif name == "equinox":
                marks.append(EQUINOX_LAST_BITS)
            rows.append(pytest.param(name, marks=marks, id=f"{name}-{mode}"))
    return rows


@pytest.mark.parametrize("name", _bitwise_rows())
def test_exact_gradients_equal_the_twin_bit_for_bit(name):
    rev, std = exact_steps(name, jnp.float32, EXACT_DEPTH)
    np.testing.assert_array_equal(rev["y"], std["y"])
    assert on_grid(rev["y"])
    leaves = jax.tree.leaves(rev["grads"]), jax.tree.leaves(std["grads"])
    assert len(leaves[0]) == len(leaves[1]) >= 9  # F and G's parameters, and x
    for n, (r, s) in enumerate(zip(*leaves)):
        assert np.array_equal(r, s), (n, float(jnp.max(jnp.abs(r - s))))


@pytest.mark.parametrize("dtype", [F64])
@pytest.mark.parametrize("name", EXACT_DOORS)
def test_exact_gradients_in_float64_equal_the_twin(name, dtype):
    with x64(dtype):
        rev, std = exact_steps(name, dtype, 8)
        assert rev["y"].dtype == jnp.float64 and on_grid(rev["y"])
        np.testing.assert_array_equal(rev["y"], std["y"])
        rtol = 1e-12  # exact reconstruction: the backward's float64 rounding only
        assert_trees_close(rev["grads"], std["grads"], rtol, "exact grads")


@pytest.mark.parametrize("name, make, error, message", _error_rows("EXACT_ERRORS"))
def test_exact_mode_refuses_in_one_line(name, make, error, message):
    with pytest.raises(error, match=message) as info:
        make()
    text = str(info.value)
    assert "\n" not in text.strip(), text
    assert re.match(r"(Affine|Additive|affine_|additive_)\w*:", text), text


@pytest.mark.slow
@pytest.mark.parametrize("name", EXACT_DOORS)
def test_exact_memory_is_flat_in_depth(name):
    exact = {d: train_step_temp(name, d, True, exact=True) for d in (4, 32)}
    plain = train_step_temp(name, 32, True)
    print(f"{name}: exact {exact}, inexact at 32 {plain}")
    assert exact[32] <= 1.1 * exact[4], exact
    assert exact[32] <= plain, (exact, plain)


@pytest.mark.parametrize("name", EXACT_DOORS)
def test_leaving_the_exact_range_is_named_in_one_line(name):
    built = load(name).build(2, dtype=jnp.float32, reversible=True, exact=True)

    def loss(params, x):
        return jnp.sum(jnp.sin(built.apply(params, fresh(built.state), x, KEY)[0]))

    grad = jax.grad(loss, (0, 1))
    grad(built.params, built.x)  # in range: no error
    with runtime_checks(True):
        with pytest.raises(revnet.NotInvertibleError) as info:
            grad(built.params, 1e5 * built.x)
            jax.effects_barrier()
    text = str(info.value)
    coupling = COUPLING.get(name, "AdditiveCoupling")
    assert text.startswith(f"{coupling} left its exact range"), text
    assert "exact range" in text and "\n" not in text.strip(), text
