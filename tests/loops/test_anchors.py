"""Anchors and the drift monitor in ``revnet.scan``.

With ``anchor_every=k`` the forward pass stores the carry before every
``k``-th step and the backward pass continues from each stored carry. The
gradients are those of the same loop (checked elementwise against
``jax.grad`` of ``lax.scan``, float32 and float64, every input and closed-over
parameter); the drift monitor's readings are checked against reconstruction
errors measured independently (each segment inverted on its own with
``revnet.inverse``); memory is read from compiled programs.
"""

from __future__ import annotations

import copy
import functools
import pickle
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import revnet
from tests.helpers import assert_trees_close, boundary_check, temp_bytes, tolerance

N = 11


def _weights(dtype, n=N, d=4, gain=0.9, seed=0):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    w = gain * jax.random.normal(k1, (n, 2, d, d)) / np.sqrt(d)
    return w.astype(dtype), (0.1 * jax.random.normal(k2, (d,))).astype(dtype)


def _coupling(b, c, w):
    """One additive coupling step: invertible in the carry ``c = (x1, x2)``."""
    x1, x2 = c
    x1 = x1 + jnp.tanh(x2 @ w[0] + b)
    x2 = x2 + jnp.tanh(x1 @ w[1])
    return (x1, x2), jnp.sum(x1 * x2, axis=-1)


def _contracting(b, c, w):
    """An invertible step whose inverse amplifies rounding error 4x a step."""
    x1, x2 = c
    x1 = x1 + jnp.tanh(x2 @ w[0] + b)
    x2 = 0.25 * x2 + jnp.tanh(x1 @ w[1])
    return (x1, x2), jnp.sum(x1 * x2, axis=-1)


def _carry(dtype, batch=(3,), d=4, seed=1):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return (
        jax.random.normal(k1, (*batch, d)).astype(dtype),
        jax.random.normal(k2, (*batch, d)).astype(dtype),
    )


def _loss(scan_fn, w, b, c, step=_coupling, **kw):
    (x1, x2), ys = scan_fn(functools.partial(step, b), c, w, **kw)
    return jnp.sum(jnp.sin(x1) * x2) + jnp.sum(jnp.cos(ys))


def _grads(scan_fn, w, b, c, **kw):
    loss = functools.partial(_loss, scan_fn, **kw)
    return jax.value_and_grad(loss, argnums=(0, 1, 2))(w, b, c)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("every", [1, 3, 4, N, 20])
@pytest.mark.slow
def test_anchored_gradients_equal_plain_autodiff(every, reverse, dtype):
    with jax.enable_x64(dtype == jnp.float64):
        w, b = _weights(dtype)
        c = _carry(dtype)
        monitor = revnet.DriftMonitor()
        got = jax.jit(
            lambda w, b, c: _grads(
                revnet.scan, w, b, c, reverse=reverse, anchor_every=every, drift=monitor
            )
        )(w, b, c)
        want = _grads(lax.scan, w, b, c, reverse=reverse)
        assert_trees_close(
            got, want, tolerance(dtype, loops=True), f"anchor_every={every}"
        )
        jax.effects_barrier()
        assert monitor.latest.shape == (-(-N // every),)


@settings(max_examples=6)
@given(
    n=st.integers(1, 20),
    every=st.integers(1, 24),
    reverse=st.booleans(),
    batch=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
@pytest.mark.slow
def test_anchored_gradients_for_drawn_lengths(n, every, reverse, batch, seed):
    w, b = _weights(jnp.float32, n=n, seed=seed)
    c = _carry(jnp.float32, batch=(batch,), seed=seed + 1)
    monitor = revnet.DriftMonitor()
    kw = dict(reverse=reverse, anchor_every=every, drift=monitor)
    got = jax.jit(lambda w, b, c: _grads(revnet.scan, w, b, c, **kw))(w, b, c)
    want = _grads(lax.scan, w, b, c, reverse=reverse)
    assert_trees_close(
        got, want, tolerance(jnp.float32, loops=True), f"n={n}, every={every}"
    )
    jax.effects_barrier()
    assert monitor.latest.shape == (-(-n // every),)


def _leapfrog_max(p, c, x):
    """Partly invertible: ``(q, v)`` can be rebuilt, the running maximum not."""
    q, v, top = c
    v = v - 0.5 * x * jnp.tanh(q @ p)
    q = q + x * v
    v = v - 0.5 * x * jnp.tanh(q @ p)
    return (q, v, jnp.maximum(top, jnp.max(jnp.abs(q), axis=-1))), jnp.sum(q)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=["f32", "f64"])
def test_anchors_compose_with_stored_leaves(dtype):
    with jax.enable_x64(dtype == jnp.float64):
        p = _weights(dtype)[0][0, 0]
        q, v = _carry(dtype)
        xs = jnp.linspace(0.1, 0.3, 9).astype(dtype)

        def loss(scan_fn, p, q, v, **kw):
            c = (q, v, jnp.zeros(q.shape[:-1], dtype))
            (q, v, top), ys = scan_fn(functools.partial(_leapfrog_max, p), c, xs, **kw)
            return jnp.sum(q * v) + jnp.sum(top) + jnp.sum(jnp.sin(ys))

        got = jax.jit(
            jax.grad(functools.partial(loss, revnet.scan, anchor_every=4), (0, 1, 2))
        )(p, q, v)
        want = jax.grad(functools.partial(loss, lax.scan), (0, 1, 2))(p, q, v)
        assert_trees_close(
            got, want, tolerance(dtype, loops=True), "stored and anchored"
        )


def test_anchors_under_vmap_and_checkpointing():
    w, b = _weights(jnp.float32)
    c = _carry(jnp.float32, batch=(5, 3))
    monitor = revnet.DriftMonitor()

    def per_element(scan_fn, w, b, c, **kw):
        return _loss(scan_fn, w, b, c, **kw)

    def batched(scan_fn, **kw):
        def f(w, b, c):
            one = functools.partial(per_element, scan_fn, w, b, **kw)
            return jnp.sum(jax.vmap(one)(c))

        return jax.grad(f, argnums=(0, 1, 2))

    want = batched(lax.scan)(w, b, c)
    got = jax.jit(batched(revnet.scan, anchor_every=4, drift=monitor))(w, b, c)
    assert_trees_close(got, want, tolerance(jnp.float32, loops=True), "vmap")
    jax.effects_barrier()
    # Under vmap the loop is ONE scan of the batched body: one reading, the
    # relative error over the whole batch at each of its 3 anchors.
    assert [r.drift.shape for r in monitor.readings] == [(3,)]
    # A checkpointed loop recomputes exactly: anchors are not used, nothing is
    # reported, and the gradients are the same.
    monitor.clear()
    got = jax.jit(
        batched(revnet.scan, anchor_every=4, drift=monitor, mode="checkpoint")
    )(w, b, c)
    assert_trees_close(got, want, tolerance(jnp.float32, loops=True), "checkpointed")
    jax.effects_barrier()
    assert monitor.readings == []


# --------------------------------------------------------------------------- #
# The drift monitor against reconstruction errors measured independently.


def _segment_errors(w, b, c, every, reverse=False):
    """Rebuilds each segment's first carry from its exact last one, alone."""
    n = len(w)
    order = np.arange(n)[::-1] if reverse else np.arange(n)
    step = functools.partial(_contracting, b)
    carries = [c]
    for t in order:
        carries.append(step(carries[-1], w[t])[0])
    errors = []
    for lo in range(0, n, every):
        hi = min(lo + every, n)
        seg = w[order[lo:hi]]

        def run(c, seg=seg):
            return lax.scan(step, c, seg)[0]

        (rebuilt,) = revnet.inverse(run, carries[lo])(carries[hi])
        exact = carries[lo]
        num = sum(float(jnp.sum((r - e) ** 2)) for r, e in zip(rebuilt, exact))
        den = sum(float(jnp.sum(e**2)) for e in exact)
        errors.append(np.sqrt(num / den))
    return np.array(errors)


@pytest.mark.optimized
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("every, n", [(4, 12), (6, 12), (None, 6)])
@pytest.mark.slow
def test_drift_readings_match_the_reconstruction_error(every, n, reverse):
    w, b = _weights(jnp.float32, n=n)
    c = _carry(jnp.float32)
    monitor = revnet.DriftMonitor()
    kw = dict(reverse=reverse, anchor_every=every, drift=monitor, step=_contracting)
    jax.jit(lambda w, b, c: _grads(revnet.scan, w, b, c, **kw))(w, b, c)
    jax.effects_barrier()
    got = monitor.latest
    want = _segment_errors(w, b, c, every or n, reverse)
    # Real drift, many times float32's rounding.
    assert want.min() > 8 * np.finfo(np.float32).eps, want
    np.testing.assert_allclose(got, want, rtol=0.1)  # a drift estimate within 10%
    (reading,) = monitor.readings
    assert reading.source == "revnet.scan(_contracting)"


def _ill_conditioned(monitor, **kw):
    """A stack whose inverse amplifies rounding error enormously."""
    w, b = _weights(jnp.float32, n=40)
    c = _carry(jnp.float32)
    kw = dict(drift=monitor, step=_contracting, **kw)
    return jax.jit(lambda w, b, c: _grads(revnet.scan, w, b, c, **kw))(w, b, c)


def test_a_planted_ill_conditioned_stack_warns():
    monitor = revnet.DriftMonitor(tolerance=1e-3)
    with pytest.warns(revnet.DriftWarning, match=r"exceeds the tolerance 0\.001"):
        jax.block_until_ready(_ill_conditioned(monitor))
        jax.effects_barrier()
    assert monitor.max() > 1e-3  # past the monitor's tolerance
    # With anchors every step nothing drifts far enough to warn.
    quiet = revnet.DriftMonitor(tolerance=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", revnet.DriftWarning)
        jax.block_until_ready(_ill_conditioned(quiet, anchor_every=1))
        jax.effects_barrier()
    assert 0 < quiet.max() < 1e-3  # under the monitor's tolerance


def test_a_planted_ill_conditioned_stack_raises():
    monitor = revnet.DriftMonitor(tolerance=1e-3, on_exceed="raise")
    with pytest.raises(
        (revnet.DriftError, jax.errors.JaxRuntimeError),
        match=r"reconstruction drift .* at anchor 0 of revnet.scan\(_contracting\) "
        r"exceeds the tolerance 0\.001",
    ):
        jax.block_until_ready(_ill_conditioned(monitor))
        jax.effects_barrier()


# --------------------------------------------------------------------------- #
# Memory: anchors are the only thing that grows with the number of steps.


def _temp(n, every, d=256):
    w, b = _weights(jnp.float32, n=n, d=d)
    c = _carry(jnp.float32, batch=(32,), d=d)
    grad = jax.grad(functools.partial(_loss, revnet.scan, anchor_every=every), (0, 2))
    return temp_bytes(grad, w, b, c)


@pytest.mark.slow
def test_anchor_memory_grows_by_one_carry_per_anchor():
    carry = 2 * 32 * 256 * 4  # bytes of (x1, x2)
    # Without anchors only the outputs ys (32 floats a step) grow with steps.
    plain = _temp(256, None) - _temp(64, None)
    assert plain == 192 * 32 * 4, plain
    assert plain < carry

    # Anchors add one carry each: 48 more (16 -> 64 with every 4), 6 with 32;
    # and two float32 drift readings each (pooled, and leaf by leaf), in one
    # buffer (XLA's buffers on CPU are 64-byte aligned).
    def readings(n):
        return -(-8 * n // 64) * 64

    growth = readings(64) - readings(16)  # 384
    assert _temp(256, 4) - _temp(64, 4) - plain == 48 * carry + growth
    growth = readings(8) - readings(2)  # 0: both fit in 64 bytes
    assert _temp(256, 32) - _temp(64, 32) - plain == 6 * carry + growth
    with boundary_check("off"):
        assert _temp(256, 4) - _temp(64, 4) - plain == 48 * carry


# --------------------------------------------------------------------------- #
# Bad arguments: one line each.


@pytest.mark.parametrize(
    "bad, error, words",
    [
        (0, ValueError, "anchor_every must be at least 1, got 0"),
        (-3, ValueError, "anchor_every must be at least 1, got -3"),
        (2.5, TypeError, "anchor_every must be a positive integer"),
        (True, TypeError, "anchor_every must be a positive integer"),
        ("4", TypeError, "anchor_every must be a positive integer"),
    ],
)
def test_bad_anchor_every(bad, error, words):
    w, b = _weights(jnp.float32)
    with pytest.raises(error) as info:
        _loss(revnet.scan, w, b, _carry(jnp.float32), anchor_every=bad)
    message = str(info.value)
    assert "\n" not in message and message.startswith("scan: ") and words in message


def test_bad_drift_arguments():
    w, b = _weights(jnp.float32)
    with pytest.raises(TypeError, match=r"^scan: drift must be a revnet\.Drift"):
        _loss(revnet.scan, w, b, _carry(jnp.float32), drift=print)
    for kw, error in [
        (dict(tolerance=0.0), ValueError),
        (dict(tolerance=float("nan")), ValueError),
        (dict(tolerance="1e-3"), TypeError),
        (dict(on_exceed="log"), ValueError),
    ]:
        with pytest.raises(error, match="^DriftMonitor: ") as info:
            revnet.DriftMonitor(**kw)
        assert "\n" not in str(info.value)


def test_a_monitor_is_deep_copied_and_pickled_with_its_readings():
    monitor = revnet.DriftMonitor(tolerance=0.5, on_exceed="raise")
    monitor.reporter("body")(np.array([1e-6, 2e-6, 0.0]), 2)
    for copy_ in (
        copy.deepcopy(monitor),
        pickle.loads(pickle.dumps(monitor)),  # noqa: S301  (a test's own bytes)
    ):
        assert (copy_.tolerance, copy_.on_exceed) == (0.5, "raise")
        assert [r.source for r in copy_.readings] == ["body"]
        np.testing.assert_array_equal(copy_.latest, [1e-6, 2e-6])
        copy_.reporter("again")(np.array([3e-6]), 1)  # its own lock works
        assert len(copy_.readings) == 2 and len(monitor.readings) == 1
    # A model holding one (an Equinox module's field) is deep-copied too.
    holder = {"layers": [monitor], "w": jnp.ones(2)}
    assert copy.deepcopy(holder)["layers"][0].max() == 2e-6


def test_anchored_scan_inside_invertible_is_inverted_by_the_outer_function():
    w, b = _weights(jnp.float32)
    monitor = revnet.DriftMonitor()

    def inner(x1, x2):
        step = functools.partial(_coupling, b)
        return revnet.scan(step, (x1, x2), w, anchor_every=2, drift=monitor)[0]

    def plain(x1, x2):
        return lax.scan(functools.partial(_coupling, b), (x1, x2), w)[0]

    def loss(f):
        return lambda x1, x2: sum(jnp.sum(jnp.sin(y)) for y in f(x1, x2))

    c = _carry(jnp.float32)
    got = jax.jit(jax.grad(loss(revnet.invertible(inner)), (0, 1)))(*c)
    assert_trees_close(
        got, jax.grad(loss(plain), (0, 1))(*c), tolerance(jnp.float32, loops=True)
    )
    jax.effects_barrier()
    assert monitor.readings == []  # the outer function's backward has no anchors


def _counted(b, c, w):
    """``_coupling`` with an integer step counter in the carry."""
    (x1, x2), y = _coupling(b, c[:2], w)
    return (x1, x2, c[2] + 1), y


@pytest.mark.parametrize(
    "kw", [dict(unroll=3), dict(unroll=True), dict(reverse=True, unroll=2)]
)
@pytest.mark.slow
def test_anchors_with_unroll_and_an_integer_leaf(kw):
    w, b = _weights(jnp.float32)
    x1, x2 = _carry(jnp.float32)

    def loss(scan_fn, w, b, x1, x2, **extra):
        c = (x1, x2, jnp.int32(0))
        (x1, x2, n), ys = scan_fn(functools.partial(_counted, b), c, w, **kw, **extra)
        return jnp.sum(jnp.sin(x1) * x2) + jnp.sum(jnp.cos(ys)) + n

    monitor = revnet.DriftMonitor()
    anchored = functools.partial(loss, revnet.scan, anchor_every=3, drift=monitor)
    got = jax.jit(jax.value_and_grad(anchored, (0, 1, 2, 3)))(w, b, x1, x2)
    want = jax.value_and_grad(functools.partial(loss, lax.scan), (0, 1, 2, 3))(
        w, b, x1, x2
    )
    assert_trees_close(got, want, tolerance(jnp.float32, loops=True), str(kw))
    jax.effects_barrier()
    assert monitor.latest.shape == (-(-N // 3),)


def test_anchors_in_a_loop_of_no_steps():
    monitor = revnet.DriftMonitor()

    def loss(x):
        step = lambda c, _: (2.0 * c, None)  # noqa: E731
        out = revnet.scan(step, x, None, length=0, anchor_every=2, drift=monitor)[0]
        return jnp.sum(jnp.sin(out))

    x = _carry(jnp.float32)[0]
    np.testing.assert_allclose(jax.grad(loss)(x), jnp.cos(x))
    jax.effects_barrier()
    assert monitor.readings == []


# --------------------------------------------------------------------------- #
# while_loop: anchors for the steps taken, room for max_steps.


def _while_loss(w, b, c, n, step=_contracting, **kw):
    def body(s):
        (x1, x2), _ = step(b, s[:2], w)
        return x1, x2, s[2] + 1

    x1, x2, _ = revnet.while_loop(lambda s: s[2] < n, body, (*c, 0), **kw)
    return jnp.sum(jnp.sin(x1) * x2)


def _while_ref(w, b, c, n, step=_contracting):
    for _ in range(n):
        c, _ = step(b, c, w)
    return jnp.sum(jnp.sin(c[0]) * c[1])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=["f32", "f64"])
def test_while_loop_anchors_follow_the_steps_taken(dtype):
    with jax.enable_x64(dtype == jnp.float64):
        w, b = _weights(dtype, n=1)
        w = w[0]
        c = _carry(dtype)
        monitor = revnet.DriftMonitor()
        kw = dict(max_steps=50, anchor_every=3, drift=monitor, step=_coupling)
        loss = functools.partial(_while_loss, n=7, **kw)
        got = jax.jit(jax.grad(loss, (0, 1, 2)))(w, b, c)
        want = jax.grad(functools.partial(_while_ref, step=_coupling), (0, 1, 2))(
            w, b, c, 7
        )
        assert_trees_close(
            got, want, tolerance(dtype, loops=True), "while_loop anchors"
        )
        jax.effects_barrier()
    assert monitor.latest.shape == (3,)  # ceil(7 / 3) anchors of the 17 made


@pytest.mark.optimized
def test_while_loop_drift_matches_the_reconstruction_error():
    w, b = _weights(jnp.float32, n=1)
    c, n = _carry(jnp.float32), 15
    monitor = revnet.DriftMonitor()
    kw = dict(n=n, max_steps=40, anchor_every=5, drift=monitor)
    jax.jit(jax.grad(functools.partial(_while_loss, **kw), (0, 2)))(w[0], b, c)
    jax.effects_barrier()
    want = _segment_errors(jnp.stack([w[0]] * n), b, c, 5)
    assert want.min() > 8 * np.finfo(np.float32).eps, want
    np.testing.assert_allclose(monitor.latest, want, rtol=0.1)  # drift within 10%
    assert monitor.readings[-1].source == "revnet.while_loop(body)"


def test_while_loop_anchors_under_vmap_with_per_element_trip_counts():
    w, b = _weights(jnp.float32, n=1)
    c = _carry(jnp.float32, batch=(4, 3))
    stops = jnp.array([5, 0, 9, 2])
    monitor = revnet.DriftMonitor()

    def loss(w, c, **kw):
        one = lambda c, n: _while_loss(w, b, c, n, step=_coupling, **kw)  # noqa: E731
        return jnp.sum(jax.vmap(one)(c, stops))

    got = jax.jit(
        jax.grad(functools.partial(loss, max_steps=16, anchor_every=4, drift=monitor))
    )(w[0], c)

    def ref(w, c):
        return sum(
            _while_ref(w, b, tuple(a[e] for a in c), int(stops[e]), step=_coupling)
            for e in range(4)
        )

    assert_trees_close(got, jax.grad(ref)(w[0], c), tolerance(jnp.float32, loops=True))
    jax.effects_barrier()
    # One reading per element, one entry per anchor it used.
    assert sorted(r.drift.shape for r in monitor.readings) == [(0,), (1,), (2,), (3,)]


def test_while_loop_anchor_every_needs_max_steps():
    w, b = _weights(jnp.float32, n=1)
    with pytest.raises(ValueError, match="^while_loop: anchor_every needs max_steps"):
        _while_loss(w[0], b, _carry(jnp.float32), 3, anchor_every=2)


def test_a_monitor_reads_a_carry_of_mixed_dtypes_under_strict_promotion():
    """A float64 stream beside a weakly typed Python scalar (0.0) in the
    carry: the drift is measured without promoting one dtype to the other,
    which ``jax.numpy_dtype_promotion("strict")`` forbids."""
    monitor = revnet.DriftMonitor()

    def body(c):
        i, h, s = c
        return i + 1, h + jnp.tanh(s * 0.5), s + 0.25

    def run(h):
        _, h, s = revnet.while_loop(
            lambda c: c[0] < 3, body, (0, h, 0.0), max_steps=5, mode="invert",
            drift=monitor,
        )  # fmt: skip
        return jnp.sum(jnp.sin(h)) + s

    def plain(h):
        _, h, s = lax.fori_loop(0, 3, lambda _, c: body(c), (0, h, 0.0))
        return jnp.sum(jnp.sin(h)) + s

    with jax.enable_x64(True), jax.numpy_dtype_promotion("strict"):
        h = jnp.linspace(-0.5, 0.5, 3)
        got = jax.grad(run)(h)
        jax.effects_barrier()
        assert_trees_close(got, jax.grad(plain)(h), tolerance(jnp.float64))
    # float64: the drift is rounding, far under float32's
    assert monitor.latest is not None and monitor.max() < 1e-12, monitor.latest
