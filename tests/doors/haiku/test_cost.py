"""Memory and compute of the reversible training step, from XLA's plans.

Measured with run-time checks off, the library's default.
``temp_size_in_bytes`` is the activation/workspace memory XLA plans for the
compiled ``jit(grad(loss))``; ``cost_analysis()["flops"]`` counts a loop body
once, so reversible and standard scans of the same depth are compared per
step, and unrolled chains are compared in full.
"""

from __future__ import annotations

import functools

import haiku as hk
import jax
import jax.numpy as jnp
import pytest

from revnet import blocks
from tests.doors.haiku.descriptors import affine
from tests.helpers import (
    boundary_check,
    compiled,
    flop_count,
    runtime_checks,
    temp_size,
)


def wide_additive(h: jax.Array) -> jax.Array:
    half = h.shape[-1] // 2
    mlp = lambda u: hk.nets.MLP([64, half], activation=jnp.tanh)(u)  # noqa: E731
    return blocks.AdditiveCoupling(mlp, mlp)(h)


def sequence(depth: int, reversible: bool):
    return hk.transform_with_state(
        lambda x: blocks.ReversibleSequence(
            wide_additive, depth, reversible=reversible
        )(x)
    )


def anchored(depth: int, reversible: bool):
    # Anchors every 4 layers; the twin is the same standard backprop.
    return hk.transform_with_state(
        lambda x: blocks.ReversibleSequence(
            wide_additive, depth, reversible=reversible, anchor_every=4
        )(x)
    )


def revnet(depth: int, reversible: bool):
    # Two stages of depth // 2 units each, and one non-reversible transition.
    config = blocks.RevNetConfig((depth // 2, depth // 2), (8, 8, 16))
    return hk.transform_with_state(
        lambda x: blocks.RevNet(config, 10, reversible=reversible)(x, True)
    )


def chain(depth: int, reversible: bool):
    # A heterogeneous list is unrolled, yet its memory must not grow either.
    return hk.transform_with_state(
        lambda x: blocks.ReversibleSequence(
            [wide_additive] * depth, reversible=reversible
        )(x)
    )


def transformer(depth: int, reversible: bool):
    # The attention's softmax holds a stop_gradient: no cotangent may flow there.
    return hk.transform_with_state(
        lambda x: blocks.ReversibleTransformer(
            depth, num_heads=4, model_size=64, mlp_size=128, reversible=reversible
        )(x, True)
    )


SHAPES = {
    sequence: (256, 64),
    anchored: (256, 64),
    revnet: (8, 8, 8, 3),
    chain: (256, 64),
    transformer: (8, 64, 64),
}


@functools.cache
def train_step(model, depth: int, reversible: bool, check: str = "warn"):
    """The compiled ``jit(grad(loss))`` of a model (parameters never built),
    with the boundary check as ``check`` sets it (the default: on)."""
    with boundary_check(check):
        return _train_step(model, depth, reversible)


def _train_step(model, depth: int, reversible: bool):
    net = model(depth, reversible)
    x = jax.ShapeDtypeStruct(SHAPES[model], jnp.float32)
    params, state = jax.eval_shape(net.init, jax.random.PRNGKey(0), x)

    def loss(params, state, x):
        return jnp.sum(jnp.sin(net.apply(params, state, None, x)[0]))

    with runtime_checks(False):  # measure the library's default
        return compiled(jax.grad(loss), params, state, x)


def temp(model, depth, reversible, check="warn"):
    return temp_size(train_step(model, depth, reversible, check))


@pytest.mark.parametrize(
    "model, depths", [(sequence, (4, 64)), (revnet, (4, 64)), (chain, (4, 16))]
)
@pytest.mark.slow
def test_activation_memory_is_flat_in_depth(model, depths):
    small, large = depths
    rev = {d: temp(model, d, True) for d in depths}
    std = {d: temp(model, d, False) for d in depths}
    print(f"{model.__name__}: reversible {rev}, standard {std}")
    assert rev[large] <= 1.10 * rev[small]
    # The twin stores activations per block: (at least half-)linear growth.
    assert std[large] >= (large / small) / 2 * std[small]
    assert rev[large] * (large / small) / 2 <= std[large]


def flop_ratio(model, depth, check="off"):
    """FLOPs reversible / standard; the 4/3 bound is the structure's, so
    measured with the boundary check off (its cost: test_the_check_costs)."""
    rev = flop_count(train_step(model, depth, True, check))
    return rev / flop_count(train_step(model, depth, False))


def test_anchors_add_one_activation_each():
    activation = 256 * 64 * 4
    growth = temp(anchored, 64, True, "off") - temp(anchored, 4, True, "off")
    assert growth == (64 // 4 - 4 // 4) * activation, growth
    assert temp(anchored, 64, True) * 4 <= temp(anchored, 64, False)
    # The boundary check reads the drift at every anchor: two float32 each,
    # and at most one more activation (one carry) live while it compares.
    for depth in (4, 64):
        extra = temp(anchored, depth, True) - temp(anchored, depth, True, "off")
        # (The bound is the promise; XLA may schedule the checked program
        # tighter than the unchecked one: 16 KiB less at depth 4 under jax 0.12.)
        assert extra <= activation + 8 * (depth // 4) + 64, (depth, extra)


@pytest.mark.parametrize("model", [sequence, anchored, revnet, transformer])
def test_the_boundary_check_costs_under_two_percent_of_flops(model):
    assert flop_ratio(model, 4, "warn") <= 1.02 * flop_ratio(model, 4), model


@pytest.mark.parametrize("model", [sequence, anchored, revnet, transformer])
def test_reversible_flops_within_limit(model):
    ratio = flop_ratio(model, 4)
    print(f"{model.__name__}: FLOP ratio {ratio:.3f}")
    # Fused backward: 4/3 for the couplings (plus cheap non-reversible parts).
    # The lower bound shows the blocks really are recomputed.
    assert 1.1 <= ratio <= 1.34


def test_unrolled_chain_flops_within_limit():
    """A heterogeneous list is unrolled, so every block is counted."""

    def chain(reversible):
        return hk.transform_with_state(
            lambda x: blocks.ReversibleSequence(
                [wide_additive, affine, wide_additive], reversible=reversible
            )(x)
        )

    x = jax.ShapeDtypeStruct((256, 64), jnp.float32)

    def step_flops(reversible):
        net = chain(reversible)
        params, state = jax.eval_shape(net.init, jax.random.PRNGKey(0), x)

        def loss(params, state, x):
            return jnp.sum(jnp.sin(net.apply(params, state, None, x)[0]))

        with runtime_checks(False):
            step = compiled(jax.grad(loss), params, state, x)
        return flop_count(step)

    ratio = step_flops(True) / step_flops(False)
    print(f"unrolled chain: FLOP ratio {ratio:.3f}")
    assert 1.1 <= ratio <= 1.34


def unrolled(forward, remat: bool):
    """``forward`` with each sequence unrolled: reversible, or ``hk.remat``'d.

    Every ``ReversibleSequence`` (and transformer stage) of one repeated block
    runs as a Python chain: a reversible list of blocks, or the remat twin,
    ``hk.layer_stack`` + ``hk.remat`` as a loop. A scan's body is counted
    once, so neither twin scans.
    """
    inside = []

    def unroll(next_f, args, kwargs, context):
        seq = context.module
        if (
            inside
            or not isinstance(seq, blocks.ReversibleSequence)
            or context.method_name != "__call__"
        ):
            return next_f(*args, **kwargs)
        ((block_fn,), (x, *rest)) = seq.block_fns, args
        layer = functools.partial(block_fn, *rest, **kwargs)
        inside.append(seq)
        try:
            if not remat:
                return blocks.ReversibleSequence([layer] * seq.num_layers)(x)
            for i in range(seq.num_layers):
                with hk.name_scope(f"layer_{i}"):
                    x = hk.remat(layer)(x)
            return x
        finally:
            inside.pop()

    def run(x):
        with hk.intercept_methods(unroll):
            return forward(x)

    return hk.transform_with_state(run)


def transformer_forward(depth: int, mlp_size: int = 128):
    return lambda x: blocks.ReversibleTransformer(
        depth, num_heads=4, model_size=64, mlp_size=mlp_size
    )(x, True)


def conv_forward(depth: int):
    # The peers' block: Conv2D - BatchNorm - ReLU - Conv2D on half the channels.
    def residual(h):
        h = hk.BatchNorm(True, True, 0.9)(hk.Conv2D(8, 3)(h), True)
        return hk.Conv2D(8, 3)(jax.nn.relu(h))

    block = lambda h: blocks.AdditiveCoupling(residual, residual)(h)  # noqa: E731
    return lambda x: blocks.ReversibleSequence(block, depth)(x)


def door_forward(depth: int):
    # The front doors' block (benchmarks.front_doors), at a smaller width.
    def residual(h):
        h = jnp.tanh(hk.Linear(128)(hk.LayerNorm(-1, True, True)(h)))
        return hk.Linear(32)(h)

    block = lambda h: blocks.AdditiveCoupling(residual, residual)(h)  # noqa: E731
    return lambda x: blocks.ReversibleSequence(block, depth)(x)


def mlp_forward(depth: int):
    # The MLP coupling stack of benchmarks.models: f and g are tanh(Linear).
    def block(h):
        f = lambda u: jnp.tanh(hk.Linear(32)(u))  # noqa: E731
        return blocks.AdditiveCoupling(f, f)(h)

    return lambda x: blocks.ReversibleSequence(block, depth)(x)


BLOCKS = {
    "transformer": (transformer_forward, (8, 64, 64)),
    "conv": (conv_forward, (8, 8, 8, 16)),
    "door": (door_forward, (128, 64)),
    "mlp": (mlp_forward, (128, 64)),
}


def block_flops(model: str, remat: bool, **sizes) -> float:
    """FLOPs per layer of a training step: depth 2 minus depth 1."""
    make, shape = BLOCKS[model]
    x = jax.ShapeDtypeStruct(shape, jnp.float32)

    def step_flops(depth):
        net = unrolled(make(depth, **sizes), remat)
        params, state = jax.eval_shape(net.init, jax.random.PRNGKey(0), x)

        def loss(params, state, x):
            return jnp.sum(jnp.sin(net.apply(params, state, None, x)[0]))

        with runtime_checks(False):
            return flop_count(compiled(jax.grad(loss), params, state, x))

    return step_flops(2) - step_flops(1)


@pytest.mark.parametrize("mlp_size", [128, 256])
def test_transformer_flops_at_structural_bound(mlp_size):
    """Per layer, the reversible step does remat's work plus G's last linear.

    Rebuilding ``x2 = y2 - G(y1)`` needs all of ``G(y1)``; remat's recompute
    stops at the input of G's last linear (its VJP needs no output). So the
    bound on reversible / remat is ``1 + L / remat``, with ``L`` that linear's
    forward FLOPs: ``4 / 3.75 = 1.067`` where ``L`` is a quarter of the block's
    forward (conv), more where the MLP is wider. A duplicated projection,
    LayerNorm or softmax would exceed it.
    """
    batch, time, model_size = BLOCKS["transformer"][1]
    last_linear = 2 * batch * time * mlp_size * (model_size // 2)
    rev, remat = (
        block_flops("transformer", r, mlp_size=mlp_size) for r in (False, True)
    )
    print(
        f"mlp {mlp_size}: reversible / remat {rev / remat:.4f}, "
        f"bound {(remat + last_linear) / remat:.4f}"
    )
    assert remat < rev <= remat + last_linear
    if mlp_size == 2 * model_size:  # L a quarter of the forward's matmuls
        assert rev / remat <= 1.07


@pytest.mark.parametrize("model, bound", [("conv", 1.07), ("door", 1.07)])
def test_block_flops_within_remat_bound(model, bound):
    """Where G's last layer is a quarter of the block's forward, as in the
    peers' conv block and the front doors' block, the reversible layer costs
    at most 1.07x the ``layer_stack`` + remat layer, and more than it (the
    layer really is run again)."""
    rev, remat = (block_flops(model, r) for r in (False, True))
    print(f"{model}: reversible / remat {rev / remat:.4f}")
    assert remat < rev <= bound * remat


def test_mlp_flops_equal_remat():
    """With ``f`` and ``g`` each one ``tanh(Linear)``, remat recomputes all of
    ``G`` too (tanh's VJP needs its output): the two layers cost the same."""
    rev, remat = (block_flops("mlp", r) for r in (False, True))
    print(f"mlp: reversible / remat {rev / remat:.4f}")
    assert 0.995 * remat <= rev <= 1.005 * remat
