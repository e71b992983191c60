"""Anchored reversible stacks: accuracy at depth, memory, and composition.

The must-hold figures use the numerics experiment's own depth-128 stacks
(``benchmarks.numerics``: random, non-identity parameters). Anchored float32
gradient errors are relative L2 errors against float64 backprop; the default
affine scale is checked against its standard twin in float64; memory is the
compiled ``temp_size_in_bytes`` of ``jit(grad)``.
"""

from __future__ import annotations

import textwrap

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import revnet
from benchmarks import numerics
from revnet import blocks
from tests.helpers import (
    assert_trees_close,
    cast_floats,
    run_python,
    temp_bytes,
    tolerance,
)

pytestmark = pytest.mark.slow  # depth-128 stacks and subprocesses

DEPTH = 128


def _args():
    return numerics.Config()


def _inputs(args):
    kx, kc = jax.random.split(jax.random.PRNGKey(1))
    x = jax.random.normal(kx, (args.batch, args.width), jnp.float32)
    c = jax.random.normal(kc, (args.batch, args.width), jnp.float32)
    return x, c


def _grad_fn(net):
    def loss(params, x, c):
        return jnp.sum(net.apply(params, None, x).astype(jnp.float64) * c)

    return jax.grad(loss, argnums=(0, 1))


@pytest.mark.parametrize("coupling", ["additive", "affine_bounded", "affine_default"])
@pytest.mark.optimized
def test_anchor_every_16_at_depth_128(coupling):
    """Gradient error <= 3x standard backprop's; activation memory <= 1/8.

    Compiled with XLA's optimisations, as users run it: in float32 the
    bounded affine stack at depth 128 is chaotic (the standard twin's own
    gradient error is of order one), so both errors depend on XLA's code
    generation, and without its optimisations they differ on some CPUs.
    """
    args = _args()
    x, c = _inputs(args)
    std, _ = numerics.model(coupling, DEPTH, args, reversible=False)
    anchored, _ = numerics.model(coupling, DEPTH, args, True, anchor_every=16)
    params = jax.jit(std.init)(jax.random.PRNGKey(0), x)
    with jax.enable_x64(True):
        ref = jax.jit(_grad_fn(std))(
            *(cast_floats(t, jnp.float64) for t in (params, x, c))
        )
        g_std = jax.jit(_grad_fn(std))(params, x, c)
        g_anchored = jax.jit(_grad_fn(anchored))(params, x, c)
        err_std = numerics.rel_error(g_std, ref)
        err_anchored = numerics.rel_error(g_anchored, ref)
        assert err_std > 0
        assert err_anchored <= 3 * err_std, (err_anchored, err_std)
        temp_std = temp_bytes(_grad_fn(std), params, x, c)
        temp_anchored = temp_bytes(_grad_fn(anchored), params, x, c)
    assert temp_anchored <= temp_std / 8, (temp_anchored, temp_std)


def test_the_default_affine_scale_matches_its_standard_twin_at_depth_128():
    """The default scale's reversible stack agrees with its standard twin.

    What the library guarantees: the inverse rebuilds the input and the
    reversible backward pass gives the standard twin's gradients, up to the
    dtype's rounding. Checked in float64 on the numerics experiment's depth-128
    stack (random, non-identity parameters), within ``tolerance(float64)``.
    float32 at this depth is left to the anchored test above: there rounding
    noise is amplified through 128 inverses, and anchors are what bound it.
    """
    args = _args()
    x, c = _inputs(args)
    std, _ = numerics.model("affine_default", DEPTH, args, reversible=False)
    rev, inv = numerics.model("affine_default", DEPTH, args, reversible=True)
    params = jax.jit(std.init)(jax.random.PRNGKey(0), x)
    with jax.enable_x64(True):
        params, x, c = (cast_floats(t, jnp.float64) for t in (params, x, c))
        tol = tolerance(jnp.float64)
        y = jax.jit(rev.apply)(params, None, x)
        assert_trees_close(y, jax.jit(std.apply)(params, None, x), tol, "outputs")
        rebuilt = jax.jit(inv.apply)(params, None, y)
        assert_trees_close(rebuilt, x, tol, "reconstruction", floor=0)
        g_rev = jax.jit(_grad_fn(rev))(params, x, c)
        g_std = jax.jit(_grad_fn(std))(params, x, c)
        assert_trees_close(g_rev, g_std, tol, "gradients vs the standard twin")


def test_anchor_every_one_holds_one_activation_per_layer():
    args = _args()
    x, c = _inputs(args)
    activation = x.size * x.dtype.itemsize

    def growth(**kw):
        temps = []
        for depth in (16, 64):
            net, _ = numerics.model("additive", depth, args, **kw)
            params = jax.jit(net.init)(jax.random.PRNGKey(0), x)
            with jax.enable_x64(True):  # the experiment's float64 loss
                temps.append(temp_bytes(_grad_fn(net), params, x, c))
        return temps[1] - temps[0]

    assert growth(reversible=True) == 0
    # One activation per layer, and two float32 drift readings per anchor.
    assert growth(reversible=True, anchor_every=1) == 48 * (activation + 8)
    # Ordinary backprop's memory is of the same order: it grows with depth too.
    assert growth(reversible=False) >= 48 * activation


# --------------------------------------------------------------------------- #
# Composition: dropout replay, BatchNorm once, compute_dtype, jit and vmap.


def _block(h, is_training, compute_dtype=None, batch_norm=True):
    half = h.shape[-1] // 2

    def f(z):
        z = hk.Linear(half)(z)
        if batch_norm:
            z = hk.BatchNorm(True, True, 0.9)(z, is_training)
        return jnp.tanh(z)

    def g(z):
        z = jnp.tanh(hk.Linear(16)(z))
        if is_training:
            z = hk.dropout(hk.next_rng_key(), 0.25, z)
        return hk.Linear(half)(z)

    return blocks.AdditiveCoupling(f, g, compute_dtype=compute_dtype)(h)


def _net(reversible, anchor_every=None, drift=None, **block_kw):
    def fn(x):
        seq = blocks.ReversibleSequence(
            lambda h: _block(h, True, **block_kw),
            11,
            reversible=reversible,
            anchor_every=anchor_every,
            drift=drift,
        )
        return seq(x)

    return hk.transform_with_state(fn)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=["f32", "f64"])
def test_anchors_replay_dropout_and_update_batch_norm_once(dtype):
    with jax.enable_x64(dtype == jnp.float64):
        x = jax.random.normal(jax.random.PRNGKey(1), (6, 8), dtype)
        rng = jax.random.PRNGKey(7)
        params, state = jax.jit(_net(False).init)(jax.random.PRNGKey(0), x)
        params, state = cast_floats((params, state), dtype)

        def run(net):
            def loss(p):
                y, new_state = net.apply(p, state, rng, x)
                return jnp.sum(jnp.sin(y)), new_state

            return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

        monitor = revnet.DriftMonitor()
        (loss_a, state_a), g_a = run(_net(True, anchor_every=4, drift=monitor))
        (loss_s, state_s), g_s = run(_net(False))
        jax.effects_barrier()
        tol = tolerance(dtype)
        np.testing.assert_allclose(loss_a, loss_s, rtol=tol)
        assert_trees_close(g_a, g_s, tol, "anchored vs twin gradients")
        # The state moved, and exactly as the twin's did (one update per step).
        assert_trees_close(state_a, state_s, tol, "BatchNorm state")
        moved = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), state_a, state)
        assert max(jax.tree.leaves(moved)) > 1e-3  # moved, beyond rounding
    assert monitor.latest.shape == (3,) and monitor.max() < 100 * tol


def test_anchors_with_bfloat16_compute_match_the_same_policy_twin():
    x = jax.random.normal(jax.random.PRNGKey(1), (6, 8))
    rng = jax.random.PRNGKey(7)
    kw = dict(compute_dtype=jnp.bfloat16, batch_norm=False)
    params, state = jax.jit(_net(False, **kw).init)(jax.random.PRNGKey(0), x)

    def grads(net):
        def loss(p):
            return jnp.sum(jnp.sin(net.apply(p, state, rng, x)[0]))

        return jax.jit(jax.grad(loss))(params)

    g_anchored = grads(_net(True, anchor_every=3, **kw))
    assert {g.dtype for g in jax.tree.leaves(g_anchored)} == {jnp.dtype(jnp.float32)}
    assert_trees_close(g_anchored, grads(_net(False, **kw)), tolerance(jnp.float32))


def test_anchors_under_vmap():
    xs = jax.random.normal(jax.random.PRNGKey(1), (3, 6, 8))
    rng = jax.random.PRNGKey(7)
    params, state = jax.jit(_net(False, batch_norm=False).init)(
        jax.random.PRNGKey(0), xs[0]
    )

    def grads(net):
        def loss(p):
            one = lambda x: net.apply(p, state, rng, x)[0]  # noqa: E731
            return jnp.sum(jnp.sin(jax.vmap(one)(xs)))

        return jax.jit(jax.grad(loss))(params)

    want = grads(_net(False, batch_norm=False))
    got = grads(_net(True, anchor_every=4, batch_norm=False))
    assert_trees_close(got, want, tolerance(jnp.float32))


def test_anchors_and_drift_need_a_single_block_fn():
    for kw in (dict(anchor_every=2), dict(drift=revnet.DriftMonitor())):
        with pytest.raises(ValueError, match="need a single block_fn") as info:
            hk.transform(
                lambda kw=kw: blocks.ReversibleSequence([_block, _block], **kw)
            ).init(None)
        assert "\n" not in str(info.value)


@pytest.mark.optimized
def test_drift_monitor_reads_the_true_reconstruction_error():
    """The backward pass's readings equal segment-wise inversions, within 10%.

    Both are float32 rounding of two XLA programs, compiled as users compile
    them: with XLA's optimisations off, jax 0.12's XLA rounds the stacked
    backward pass and the segments differently (readings up to 5x apart at
    1e-6), while with them on the two agree exactly under 0.10 and 0.12."""
    args = _args()
    x, c = _inputs(args)
    monitor = revnet.DriftMonitor()
    std, _ = numerics.model("affine_bounded", DEPTH, args, reversible=False)
    anchored, _ = numerics.model("affine_bounded", DEPTH, args, True, 16, monitor)
    params = jax.jit(std.init)(jax.random.PRNGKey(0), x)
    with jax.enable_x64(True):
        jax.block_until_ready(jax.jit(_grad_fn(anchored))(params, x, c))
        jax.effects_barrier()
    truth = np.array(numerics.true_drift("affine_bounded", args, params, x, 16))
    assert monitor.latest.shape == truth.shape == (DEPTH // 16,)
    assert truth.max() > 100 * np.finfo(np.float32).eps  # real drift, not rounding
    np.testing.assert_allclose(monitor.latest, truth, rtol=0.1)  # drift within 10%


def test_drift_monitor_flags_the_old_soft_clamp_at_depth_128():
    args = _args()
    x, c = _inputs(args)
    std, _ = numerics.model("affine_bounded", DEPTH, args, reversible=False)
    params = jax.jit(std.init)(jax.random.PRNGKey(0), x)
    for on_exceed in ("warn", "raise"):
        monitor = revnet.DriftMonitor(tolerance=1e-2, on_exceed=on_exceed)
        net, _ = numerics.model("affine_bounded", DEPTH, args, True, drift=monitor)
        step = jax.jit(_grad_fn(net))
        expect = (
            pytest.warns(revnet.DriftWarning, match="exceeds the tolerance")
            if on_exceed == "warn"
            else pytest.raises(
                (revnet.DriftError, jax.errors.JaxRuntimeError),
                match="exceeds the tolerance",
            )
        )
        with jax.enable_x64(True), expect:
            jax.block_until_ready(step(params, x, c))
            jax.effects_barrier()


# --------------------------------------------------------------------------- #
# The 8-device run: anchors under a data-parallel sharded jit.

_EIGHT_DEVICES = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from tests.loops.test_anchored_stacks import _net
    from tests.helpers import assert_trees_close, cast_floats, tolerance

    assert jax.device_count() == 8
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 8))
    rng = jax.random.PRNGKey(7)
    params, state = jax.jit(_net(False).init)(jax.random.PRNGKey(0), x)

    def step(net):
        def loss(p, s, x):
            y, new_state = net.apply(p, s, rng, x)
            return jnp.sum(jnp.sin(y)), new_state
        return jax.grad(loss, has_aux=True)

    mesh = Mesh(np.array(jax.devices()), ("data",))
    rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    sharded = jax.jit(step(_net(True, anchor_every=4)),
                      in_shardings=(rep, rep, split), out_shardings=rep)
    g8, s8 = sharded(params, state, jax.device_put(x, split))
    g1, s1 = jax.jit(step(_net(False)))(params, state, x)
    assert_trees_close(g8, g1, tolerance("float32"), "gradients")
    assert_trees_close(s8, s1, tolerance("float32"), "BatchNorm state")
    print("ok", len(jax.tree.leaves(g8)))
    """
)


def test_anchors_in_a_data_parallel_run_on_8_devices():
    out = run_python("-c", _EIGHT_DEVICES, devices=8, timeout=600)
    assert out.startswith("ok "), out[-2000:]
