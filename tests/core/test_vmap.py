"""``jax.vmap`` over examples: one reversible call on the batch.

Equinox's idiom writes a model for one example and ``vmap``s it. Batched
element by element, a custom VJP's backward pass would hold each example's
cotangent of every weight at every step. revnet's calls are batched by a rule
of their own: the batched program runs as ONE reversible call (or one
``revnet.scan``), the weights unbatched, so per-example code costs what the
batched call costs. Gradients are compared with ``jax.grad`` of the same
function leaf by leaf; memory with the compiled program's
``memory_analysis``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import revnet
from tests.helpers import assert_trees_close, temp_bytes, tolerance

DEPTH, WIDTH, BATCH = 16, 64, 64
HALF = WIDTH // 2


def make_params(depth=DEPTH, dtype="float32", seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    scale = 0.5 / np.sqrt(HALF)  # well conditioned: float32 rebuilds to ~1e-6
    return {
        "w": jax.random.normal(k[0], (depth, HALF, HALF), dtype) * scale,
        "b": jax.random.normal(k[1], (depth, HALF), dtype) * 0.1,
        "v": jax.random.normal(k[2], (depth, HALF, HALF), dtype) * scale,
    }


def layer(x, p):
    a, b = jnp.split(x, 2, -1)
    a = a + jnp.tanh(b @ p["w"] + p["b"])
    b = b + jax.nn.gelu(a @ p["v"])
    return jnp.concatenate([b, a], -1), jnp.mean(a)


def stack(params, x):
    """A coupling stack for one example ``x: [WIDTH]`` (or a batch)."""
    return jax.lax.scan(layer, x, params)[0]


def per_example(f, in_axes=(None, 0), times=1):
    """The sum of ``sin(f(params, x))`` over a batch, ``f`` vmapped ``times``."""
    g = f
    for _ in range(times):
        g = jax.vmap(g, in_axes)
    return lambda p, x: jnp.sum(jnp.sin(g(p, x)))


def batched(f):
    return lambda p, x: jnp.sum(jnp.sin(f(p, x)))


def inputs(dtype, batch=BATCH):
    return make_params(dtype=dtype), jax.random.normal(
        jax.random.key(1), (batch, WIDTH), dtype
    )


REV = revnet.invertible(stack, known_argnums=0)


def scan_stack(params, x):
    h, means = revnet.scan(layer, x, params)
    return h + jnp.sum(means)


def lax_scan_stack(params, x):
    h, means = jax.lax.scan(layer, x, params)
    return h + jnp.sum(means)


CASES = {
    "invertible": (REV, stack),
    "scan": (scan_stack, lax_scan_stack),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gradients_under_vmap_equal_jax_grad(case, dtype):
    ours, plain = CASES[case]
    with jax.enable_x64(dtype == "float64"):
        params, x = inputs(dtype, batch=8)
        rtol = tolerance(dtype, loops=case == "scan")
        want = jax.grad(per_example(plain), (0, 1))(params, x)
        grad = jax.grad(per_example(ours), (0, 1))
        assert_trees_close(grad(params, x), want, rtol, "grad(vmap)", exact_dtypes=True)
        assert_trees_close(jax.jit(grad)(params, x), want, rtol, "jit(grad(vmap))")
        # Per-example gradients: vmap of grad.
        one = lambda f: lambda p, xi: jnp.sum(jnp.sin(f(p, xi)))  # noqa: E731
        each = jax.vmap(jax.grad(one(ours), (0, 1)), (None, 0))
        want_each = jax.vmap(jax.grad(one(plain), (0, 1)), (None, 0))
        assert_trees_close(each(params, x), want_each(params, x), rtol, "vmap(grad)")
        # vmap of vmap, and weights batched with the examples.
        x2 = x.reshape(2, 4, WIDTH)
        assert_trees_close(
            jax.grad(per_example(ours, times=2), (0, 1))(params, x2),
            jax.grad(per_example(plain, times=2), (0, 1))(params, x2),
            rtol,
            "grad(vmap(vmap))",
        )
        many = jax.tree.map(lambda a: jnp.stack([a, -a]), params)
        assert_trees_close(
            jax.grad(per_example(ours, 0), (0, 1))(many, x[:2]),
            jax.grad(per_example(plain, 0), (0, 1))(many, x[:2]),
            rtol,
            "batched weights",
        )


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_unbatched_input_is_rebuilt_for_the_batch(case):
    # Weights batched, the input shared: the call is batched in the input too.
    ours, plain = CASES[case]
    params, x = inputs("float32", batch=1)
    many = jax.tree.map(lambda a: jnp.stack([a, -a, 0.5 * a]), params)
    assert_trees_close(
        jax.grad(per_example(ours, (0, None)), (0, 1))(many, x[0]),
        jax.grad(per_example(plain, (0, None)), (0, 1))(many, x[0]),
        tolerance("float32", loops=True),
        "shared input",
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_per_example_memory_is_the_batched_calls(case):
    ours, plain = CASES[case]
    params, x = inputs("float32")
    per = temp_bytes(jax.grad(per_example(ours), (0, 1)), params, x)
    whole = temp_bytes(jax.grad(batched(ours), (0, 1)), params, x)
    ref = temp_bytes(jax.grad(per_example(plain), (0, 1)), params, x)
    # Per-example code holds what the batched call holds (within 1.5x; batching
    # element by element would hold batch x depth x weights), and plain
    # autodiff stores every layer.
    assert per <= 1.5 * whole, (per, whole)
    assert ref > 5 * per, (ref, per)


def test_a_named_axis_reaches_collectives_in_the_batched_call():
    # The vmapped axis keeps its name: a collective over the batch inside F.
    def norm_stack(params, x):
        def step(x, p):
            a, b = jnp.split(x, 2, -1)
            centred = b - jax.lax.pmean(b, "batch")
            a = a + jnp.tanh(centred @ p["w"])
            return jnp.concatenate([b, a], -1), None

        return jax.lax.scan(step, x, params)[0]

    params, x = inputs("float32", batch=6)
    rev = revnet.invertible(norm_stack, known_argnums=0)

    def loss(f):
        mapped = jax.vmap(f, (None, 0), axis_name="batch")
        return lambda p, x: jnp.sum(jnp.sin(mapped(p, x)))

    assert_trees_close(
        jax.grad(loss(rev), (0, 1))(params, x),
        jax.grad(loss(norm_stack), (0, 1))(params, x),
        tolerance("float32"),
        "pmean over the vmapped axis",
    )


# --------------------------------------------------------------------------- #
# The front doors, per example: Equinox's and NNX's idiom.


def _eqx_sequence(depth, **kwargs):
    eqx = pytest.importorskip("equinox")
    import revnet.eqx as reqx

    def block(key):
        kf, kg = jax.random.split(key)
        mlp = lambda k: eqx.nn.MLP(HALF, HALF, WIDTH, 1, activation=jnp.tanh, key=k)  # noqa: E731
        return reqx.AdditiveCoupling(mlp(kf), mlp(kg))

    return reqx.ReversibleSequence(block, depth, key=jax.random.key(0), **kwargs)


def _eqx_loss(seq, per):
    """``(loss, params)``: the mean loss as a function of the arrays."""
    eqx = pytest.importorskip("equinox")
    params, static = eqx.partition(seq, eqx.is_array)

    def loss(p, x):
        model = eqx.combine(p, static)
        y = eqx.filter_vmap(model)(x) if per else model(x)
        return jnp.mean(jnp.sin(y))

    return loss, params


def _nnx_sequence(depth, **kwargs):
    nnx = pytest.importorskip("flax.nnx")
    import revnet.nnx as rnnx

    class Block(nnx.Module):
        def __init__(self, *, rngs):
            self.f = nnx.Linear(HALF, HALF, rngs=rngs)
            self.g = nnx.Linear(HALF, HALF, rngs=rngs)

        def __call__(self, x):
            a, b = jnp.split(x, 2, -1)
            a = a + jnp.tanh(self.f(b))
            return jnp.concatenate([a, b + jnp.tanh(self.g(a))], -1)

    return rnnx.ReversibleSequence(Block, depth, rngs=nnx.Rngs(0), **kwargs)


def _nnx_loss(model, per):
    nnx = pytest.importorskip("flax.nnx")
    graphdef, state = nnx.split(model)

    def loss(s, x):
        m = nnx.merge(graphdef, s)
        y = jax.vmap(lambda xi: m(xi))(x) if per else m(x)
        return jnp.mean(jnp.sin(y))

    return loss, state


DOORS = {
    # door: (per-example model, batched model, per-example twin, loss)
    "equinox": (
        lambda d: _eqx_sequence(d, axis_name=None),
        lambda d: _eqx_sequence(d),
        lambda d: _eqx_sequence(d, axis_name=None, reversible=False),
        _eqx_loss,
    ),
    "nnx": (
        lambda d: _nnx_sequence(d),
        lambda d: _nnx_sequence(d),
        lambda d: _nnx_sequence(d, reversible=False),
        _nnx_loss,
    ),
}


@pytest.mark.parametrize("door", sorted(DOORS))
@pytest.mark.parametrize("depth", [4, 16])
def test_per_example_training_costs_the_batched_call(door, depth):
    make_per, make_batched, make_twin, loss_of = DOORS[door]
    x = jax.random.normal(jax.random.key(1), (BATCH, WIDTH))
    per, params = loss_of(make_per(depth), True)
    whole, whole_params = loss_of(make_batched(depth), False)
    twin, twin_params = loss_of(make_twin(depth), True)
    mem_per = temp_bytes(jax.grad(per), params, x)
    mem_whole = temp_bytes(jax.grad(whole), whole_params, x)
    assert mem_per <= 1.5 * mem_whole, (mem_per, mem_whole)
    # Element-wise batching held 70x (Equinox) and 25x (NNX) more at depth 4.
    assert temp_bytes(jax.grad(twin), twin_params, x) > 2 * mem_per


@pytest.mark.parametrize("door", sorted(DOORS))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_per_example_gradients_equal_the_twins(door, dtype):
    make_per, _, make_twin, loss_of = DOORS[door]
    with jax.enable_x64(dtype == "float64"):
        x = jax.random.normal(jax.random.key(1), (8, WIDTH), dtype)
        per, params = loss_of(make_per(4), True)
        twin, twin_params = loss_of(make_twin(4), True)
        cast = lambda t: jax.tree.map(  # noqa: E731
            lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, t
        )
        got = jax.grad(per, (0, 1))(cast(params), x)
        want = jax.grad(twin, (0, 1))(cast(twin_params), x)
        # The twin differs in static fields (reversible=False): compare leaves.
        assert_trees_close(
            jax.tree.leaves(got),
            jax.tree.leaves(want),
            tolerance(dtype),
            f"{door} per-example grads",
        )


def test_an_equinox_sequence_on_one_example_is_refused_in_one_line():
    eqx = pytest.importorskip("equinox")
    import revnet.eqx as reqx

    class Mix(eqx.Module):  # a block for ONE example of tokens x features
        f: eqx.nn.Linear

        def __init__(self, key):
            self.f = eqx.nn.Linear(HALF, HALF, key=key)

        def __call__(self, h, key=None):
            a, b = jnp.split(h, 2, -1)
            return jnp.concatenate([a + jax.vmap(self.f)(jnp.tanh(b)), b], -1)

    seq = reqx.ReversibleSequence(Mix, 2, key=jax.random.key(0))
    tokens = jnp.ones((5, WIDTH))
    with pytest.raises((TypeError, ValueError)) as err:
        seq(tokens)
    assert "axis_name=None" in str(err.value) and "(64,)" in str(err.value)
    assert len(str(err.value).splitlines()) == 1
    per = reqx.ReversibleSequence(Mix, 2, key=jax.random.key(0), axis_name=None)
    assert jax.vmap(per)(jnp.ones((3, 5, WIDTH))).shape == (3, 5, WIDTH)
    with pytest.raises(ValueError, match="axis_name=None"):
        seq(jnp.ones(WIDTH))


def test_batchnorm_under_the_users_vmap_reduces_over_its_axis():
    # Blocks for one example holding a BatchNorm over the user's named axis:
    # the new statistics do not depend on the example and come back unbatched
    # (out_axes=None), and the backward pass runs inside the named axis.
    eqx = pytest.importorskip("equinox")
    import revnet.eqx as reqx

    class Res(eqx.Module):
        lin: eqx.nn.Linear
        bn: eqx.nn.BatchNorm

        def __init__(self, key):
            self.lin = eqx.nn.Linear(4, 4, key=key, dtype=jnp.float64)
            self.bn = eqx.nn.BatchNorm(4, "batch", mode="batch", dtype=jnp.float64)

        def __call__(self, x, state, key=None):
            y, state = self.bn(self.lin(x), state)
            return jnp.tanh(y), state

    def block(key):
        kf, kg = jax.random.split(key)
        return reqx.AdditiveCoupling(Res(kf), Res(kg))

    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(1), (6, 8), jnp.float64)
        got = {}
        for rev in (True, False):
            seq, state = eqx.nn.make_with_state(reqx.ReversibleSequence)(
                block, 3, key=jax.random.key(0), axis_name=None, reversible=rev
            )
            params, static = eqx.partition(seq, eqx.is_array)

            def loss(p, x, static=static, state=state):
                model = eqx.combine(p, static)
                mapped = jax.vmap(
                    model, (0, None), out_axes=(0, None), axis_name="batch"
                )
                y, new_state = mapped(x, state)
                return jnp.sum(jnp.sin(y)), new_state

            got[rev] = jax.grad(loss, (0, 1), has_aux=True)(params, x)
        (grads, new_state), (want, want_state) = got[True], got[False]
        assert_trees_close(
            jax.tree.leaves(grads), jax.tree.leaves(want), tolerance("float64"), "grads"
        )
        assert_trees_close(
            jax.tree.leaves(new_state),
            jax.tree.leaves(want_state),
            tolerance("float64"),
            "new statistics",
        )
