"""Tests for loops over any body: inverted, stored and checkpointed carries.

Three bodies, one of each kind the loops distinguish:

* ``leapfrog``: kick-drift-kick in ``(q, p)``, invertible in its whole carry;
* ``leapfrog_max``: the same plus a running maximum of ``|q|``, which cannot be
  rebuilt (partly invertible);
* ``damped``: a damped nonlinear map ``x -> (1 - g) x + dt tanh(x W)``, which
  the analysis cannot invert (``x`` is used twice).

Every gradient is compared elementwise with ``jax.grad`` of an unrolled Python
loop of the same number of steps, for every carry leaf and every closed-over
parameter, in float32 and float64. Memory is read from compiled programs
(``memory_analysis``); body evaluations are counted with ``jax.debug.callback``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import revnet
from revnet import NotInvertibleError, loops
from revnet._engine import revolve
from revnet._engine.loops.hooks import backward_steps, modes_chosen
from revnet.loops import scan, while_loop
from tests.helpers import (
    ROOT,
    UNDER_CUSTOM_VJP3,
    assert_trees_close,
    temp_bytes,
    tolerance,
)

KINDS = ("leapfrog", "leapfrog_max", "damped")


# --------------------------------------------------------------------------- #
# The three bodies. ``x`` scales the step (1 in while loops, per step in scans).


def _params(dtype, d=3, seed=0):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {
        "w": (jax.random.normal(k1, (d, d)) / np.sqrt(d)).astype(dtype),
        "b": (0.1 * jax.random.normal(k2, (d,))).astype(dtype),
        "dt": jnp.asarray(0.2, dtype),
        "g": jnp.asarray(0.1, dtype),
    }


def _step(kind, p, c, x=1.0):
    if kind == "damped_clock":
        return (*_step("damped", p, c[:1], x), c[1] + p["dt"])
    if kind == "damped":
        (z,) = c
        z = (1 - p["g"]) * z + x * p["dt"] * jnp.tanh(z @ p["w"] + p["b"])
        return (z,)
    q, v = c[0], c[1]
    h = 0.5 * x * p["dt"]
    v = v - h * jnp.tanh(q @ p["w"] + p["b"])
    q = q + 2 * h * v
    v = v - h * jnp.tanh(q @ p["w"] + p["b"])
    if kind == "leapfrog":
        return q, v
    return q, v, jnp.maximum(c[2], jnp.max(jnp.abs(q), axis=-1))


def _init(kind, dtype, batch=(), d=3, seed=1):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    q = jax.random.normal(k1, (*batch, d)).astype(dtype)
    v = jax.random.normal(k2, (*batch, d)).astype(dtype)
    if kind == "damped":
        return (q,)
    if kind == "damped_clock":
        return q, jnp.zeros((), dtype)
    if kind == "leapfrog":
        return q, v
    return q, v, jnp.zeros(batch, dtype)


def _readout(c):
    return sum(jnp.sum(jnp.sin(a) * (k + 1)) for k, a in enumerate(c))


def _while(kind, p, c, stop, **kw):
    def body(s):
        *c, i = s
        return (*_step(kind, p, tuple(c)), i + 1)

    out = while_loop(lambda s: s[-1] < stop, body, (*c, 0), **kw)
    return _readout(out[:-1])


def _unrolled(kind, p, c, n, xs=None):
    ys = []
    for t in range(n):
        x = 1.0 if xs is None else xs[t]
        ys.append(jnp.sum(c[0]) * x)
        c = _step(kind, p, c, x)
    return c, ys


def _while_ref(kind, p, c, n):
    return _readout(_unrolled(kind, p, c, n)[0])


# --------------------------------------------------------------------------- #
# The mode rule.


@pytest.mark.parametrize(
    "kind,kw,want,stored",
    [
        ("leapfrog", dict(max_steps=50), "invert", (False, False, False)),
        ("leapfrog", dict(), "invert", (False, False, False)),
        ("leapfrog", dict(max_steps=50, mode="checkpoint"), "checkpoint", None),
        ("leapfrog_max", dict(max_steps=50), "store", (False, False, True, False)),
        # Without a bound the stored leaves have nowhere to go.
        ("leapfrog_max", dict(), "checkpoint", None),
        # The step counter is rebuilt, but a counter alone is not worth storing
        # the whole float state for.
        ("damped", dict(max_steps=50), "checkpoint", None),
        # Nor is a float clock updated from itself alone.
        ("damped_clock", dict(max_steps=50), "checkpoint", None),
        ("damped", dict(), "checkpoint", None),
    ],
)
def test_the_mode_rule(kind, kw, want, stored):
    p = _params(jnp.float32)
    with modes_chosen() as seen:
        _while(kind, p, _init(kind, jnp.float32), 3, **kw)
    assert [m.kind for m in seen] == [want]
    if stored is not None:
        assert seen[0].stored == stored


def test_scan_modes_follow_the_same_rule():
    p = _params(jnp.float32)
    xs = jnp.linspace(0.5, 1.0, 4)
    for kind, want in zip(KINDS, ("invert", "store", "checkpoint")):
        with modes_chosen() as seen:
            scan(
                lambda c, x: (_step(kind, p, c, x), None), _init(kind, jnp.float32), xs
            )
        assert [m.kind for m in seen] == [want], kind


def test_invert_true_names_the_leaf_that_cannot_be_rebuilt():
    p = _params(jnp.float32)
    c = _init("leapfrog_max", jnp.float32)
    with pytest.raises(NotInvertibleError, match=r"init_val\[2\]"):
        _while("leapfrog_max", p, c, 3, max_steps=10, mode="invert")
    with pytest.raises(NotInvertibleError, match=r"init\[0\]"):
        scan(
            lambda c, x: (_step("damped", p, c, x), None),
            _init("damped", jnp.float32),
            jnp.ones(3),
            mode="invert",
        )


# --------------------------------------------------------------------------- #
# Gradients against the unrolled loop, every body, every mode, both dtypes.


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=["f32", "f64"])
@pytest.mark.parametrize(
    "kw",
    [dict(), dict(mode="checkpoint"), dict(mode="checkpoint", checkpoints=2)],
    ids=["auto", "checkpoint", "checkpoint2"],
)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.slow
def test_while_gradients_equal_the_unrolled_loop(kind, kw, dtype):
    n = 13
    with jax.enable_x64(dtype == jnp.float64):
        p, c = _params(dtype), _init(kind, dtype, batch=(2,))
        loss = functools.partial(_while, kind, max_steps=40, **kw)
        got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(p, c, n)
        want = jax.value_and_grad(functools.partial(_while_ref, kind), (0, 1))(p, c, n)
        assert_trees_close(
            got,
            want,
            tolerance(dtype, loops=True),
            "gradient",
            floor=0.0,
            exact_dtypes=True,
        )


def _scan_loss(kind, p, c, xs, **kw):
    def f(c, x):
        return _step(kind, p, c, x), jnp.sum(c[0]) * x

    c, ys = scan(f, c, xs, **kw)
    return _readout(c) + jnp.sum(jnp.cos(ys))


def _scan_ref(kind, p, c, xs, reverse=False):
    order = xs[::-1] if reverse else xs
    c, ys = _unrolled(kind, p, c, len(xs), order)
    return _readout(c) + sum(jnp.sum(jnp.cos(y)) for y in ys)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("kw", [dict(), dict(mode="checkpoint", checkpoints=3)])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.slow
def test_scan_gradients_equal_the_unrolled_loop(kind, kw, reverse, dtype):
    with jax.enable_x64(dtype == jnp.float64):
        p, c = _params(dtype), _init(kind, dtype, batch=(2,))
        xs = jnp.linspace(0.5, 1.5, 11).astype(dtype)
        loss = functools.partial(_scan_loss, kind, reverse=reverse, **kw)
        got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(p, c, xs)
        ref = functools.partial(_scan_ref, kind, reverse=reverse)
        want = jax.value_and_grad(ref, argnums=(0, 1, 2))(p, c, xs)
        assert_trees_close(
            got,
            want,
            tolerance(dtype, loops=True),
            "gradient",
            floor=0.0,
            exact_dtypes=True,
        )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.slow
def test_vmap_with_per_element_trip_counts(kind, dtype):
    """Each element stops at its own step; gradients are exact per element."""
    stops = jnp.array([3, 11, 0, 7])
    with jax.enable_x64(dtype == jnp.float64):
        p, c = _params(dtype), _init(kind, dtype, batch=(4, 2))

        def loss(p, c):
            one = functools.partial(_while, kind, p, max_steps=16)
            return jnp.sum(jax.vmap(one)(c, stops))

        got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(p, c)

        def ref(p, c):
            return sum(
                _while_ref(kind, p, tuple(a[e] for a in c), int(stops[e]))
                for e in range(4)
            )

        want = jax.value_and_grad(ref, argnums=(0, 1))(p, c)
        assert_trees_close(
            got,
            want,
            tolerance(dtype, loops=True),
            "gradient",
            floor=0.0,
            exact_dtypes=True,
        )


@pytest.mark.optimized
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.slow
def test_hessian_is_forward_over_reverse(kind):
    with jax.enable_x64(True):
        p, c = _params(jnp.float64), _init(kind, jnp.float64)

        def loss(q, **kw):
            return _while(kind, p, (q, *c[1:]), 5, max_steps=8, **kw)

        want = jax.hessian(lambda q: _while_ref(kind, p, (q, *c[1:]), 5))(c[0])
        for kw in (dict(), dict(mode="checkpoint")):
            got = jax.hessian(loss)(c[0], **kw)
            np.testing.assert_allclose(got, want, rtol=1e-9)  # float64 hessian, 5 steps


# --------------------------------------------------------------------------- #
# Checkpointing: body evaluations and memory.


@functools.cache
def _fewest(n: int, free: int) -> int:
    """The fewest forward steps that reverse ``n`` steps with ``free`` snapshots
    besides the first: a dynamic programme over the first snapshot's place."""
    if n <= 1:
        return 0
    if free == 0:
        return n * (n - 1) // 2
    return min(m + _fewest(n - m, free - 1) + _fewest(m, free) for m in range(1, n))


def _schedule_cost(n: int, slots: int) -> int:
    """The forward steps :func:`revolve.split`'s schedule takes (pure Python)."""
    stack, cost = [0], 0
    for t in range(n - 1, -1, -1):
        s = stack[-1]
        while s < t and len(stack) < slots:
            m = int(revolve.split(t - s + 1, slots - len(stack) + 1))
            assert 1 <= m <= t - s
            cost, s = cost + m, s + m
            stack.append(s)
        cost += t - s
        if stack[-1] == t:
            stack.pop()
    assert not stack
    return cost


@pytest.mark.parametrize("slots", [1, 2, 3, 4, 6])
def test_the_schedule_is_the_fewest_evaluations(slots):
    for n in range(1, 48):
        assert _schedule_cost(n, slots) == _fewest(n, slots - 1), n


def test_the_default_snapshots_bound_the_repeats():
    # ceil(log2(max_steps)) snapshots: no step is evaluated more than
    # ceil(log2 n) + 1 times in the backward pass (the +1: the VJP's).
    for n in [*range(1, 70), 100, 1000, 4097]:
        slots = revolve.default_slots(n)
        assert slots == max(1, math.ceil(math.log2(n)))
        evaluations = _schedule_cost(n, slots) + n
        assert evaluations <= n * (math.ceil(math.log2(max(n, 1))) + 1), n
    assert revolve.default_slots(None) == revolve.UNBOUNDED_DEFAULT
    assert revolve.default_slots(0) == 1


def _count_backward_evaluations(n, **kw):
    """Body evaluations of the backward pass of a damped map taking ``n`` steps."""
    count = [0]

    def tick():
        count[0] += 1

    p = _params(jnp.float32)

    def loss(z):
        def body(s):
            z, i = s
            jax.debug.callback(tick)
            return _step("damped", p, (z,))[0], i + 1

        return jnp.sum(while_loop(lambda s: s[1] < n, body, (z, 0), **kw)[0])

    z = _init("damped", jnp.float32)[0]
    jax.block_until_ready(jax.jit(loss)(z))
    jax.effects_barrier()
    forward, count[0] = count[0], 0
    jax.block_until_ready(jax.jit(jax.grad(loss))(z))
    jax.effects_barrier()
    assert forward == n
    return count[0] - n  # the forward pass of jit(grad) takes n steps too


def test_checkpointed_backward_evaluations_follow_steps_taken():
    n = 37
    got = _count_backward_evaluations(n, max_steps=10_000)
    assert got <= n * (math.ceil(math.log2(n)) + 2), got
    # Exactly the fewest: the schedule's recomputation, plus one VJP a step.
    assert got == _fewest(n, revolve.default_slots(10_000) - 1) + n
    assert _count_backward_evaluations(n, max_steps=10_000, checkpoints=3) == (
        _fewest(n, 2) + n
    )


def test_checkpointed_memory_does_not_depend_on_max_steps():
    p = _params(jnp.float32, d=64)
    z = _init("damped", jnp.float32, batch=(16,), d=64)

    def grad_of(max_steps):
        return jax.grad(
            lambda z: _while("damped", p, z, 37, max_steps=max_steps, checkpoints=8)
        )

    small, large = temp_bytes(grad_of(1_000), z), temp_bytes(grad_of(100_000), z)
    assert small == large, (small, large)
    # And the snapshots are what it holds: 8 carries of 16 x 64 float32.
    assert small >= 8 * 16 * 64 * 4


# --------------------------------------------------------------------------- #
# Storing: only the leaves that cannot be rebuilt.


def _stored_growth(d: int, k: int) -> int:
    """Growth of temp memory from max_steps 1024 to 2048, body of width ``d``
    whose running maximum (the stored leaf) has ``k`` entries."""
    p = _params(jnp.float32, d=d)
    q, v = _init("leapfrog", jnp.float32, batch=(8,), d=d)

    def body(s):
        q, v, top, i = s
        q, v = _step("leapfrog", p, (q, v))
        return q, v, jnp.maximum(top, jnp.abs(q[0, :k])), i + 1

    def temp(max_steps):
        def loss(q, v):
            c = (q, v, jnp.zeros(k), 0)
            out = while_loop(lambda s: s[3] < 9, body, c, max_steps=max_steps)
            return _readout(out[:3])

        return temp_bytes(jax.grad(loss, argnums=(0, 1)), q, v)

    with modes_chosen() as seen:
        growth = temp(2048) - temp(1024)
    assert {m.kind for m in seen} == {"store"}
    return growth


def test_stored_memory_grows_with_the_stored_leaf_not_the_carry():
    per_step = {
        (d, k): _stored_growth(d, k) / 1024 for d, k in [(8, 4), (64, 4), (64, 32)]
    }
    # 1024 more steps hold 1024 more copies of the stored leaf (k float32s).
    assert per_step[8, 4] == 4 * 4, per_step
    assert per_step[64, 32] == 32 * 4, per_step
    # A carry 8 times wider (q and v: 8 x 64 float32s each) stores no more.
    assert per_step[64, 4] == per_step[8, 4], per_step


def test_stored_backward_runs_the_steps_taken():
    p = _params(jnp.float32)
    with backward_steps() as seen:
        g = jax.jit(
            jax.grad(lambda c: _while("leapfrog_max", p, c, 5, max_steps=1024))
        )(_init("leapfrog_max", jnp.float32))
        jax.block_until_ready(g)
    assert [int(m) for m in seen] == [5, 4, 3, 2, 1]


# --------------------------------------------------------------------------- #
# Bad input: one line, naming the argument and what was expected.


def _one_line(excinfo):
    assert "\n" not in str(excinfo.value), str(excinfo.value)


@pytest.mark.parametrize(
    "bad,exc,words",
    [
        (0, ValueError, "at least 1, got 0"),
        (-2, ValueError, "at least 1, got -2"),
        (2.5, TypeError, "positive integer"),
        (True, TypeError, "positive integer"),
        ("8", TypeError, "positive integer"),
    ],
)
def test_bad_checkpoints(bad, exc, words):
    with pytest.raises(exc, match=f"while_loop: checkpoints.*{words}") as e:
        while_loop(lambda c: c < 3.0, lambda c: c * c, 1.0, checkpoints=bad)
    _one_line(e)
    with pytest.raises(exc, match=f"scan: checkpoints.*{words}") as e:
        scan(lambda c, x: (c * x, None), 1.0, jnp.ones(3), checkpoints=bad)
    _one_line(e)


def test_bad_invert():
    with pytest.raises(TypeError, match="invert must be None.*True or False") as e:
        while_loop(lambda c: c < 3.0, lambda c: c * c, 1.0, invert="yes")
    _one_line(e)


@pytest.mark.parametrize("mode", ["auto", "checkpoint"])
def test_a_body_that_changes_the_carry_structure(mode):
    with pytest.raises(TypeError, match="same structure") as e:
        while_loop(lambda c: True, lambda c: (c, c * c), jnp.ones(2), mode=mode)
    _one_line(e)
    with pytest.raises(TypeError, match="same structure") as e:
        scan(lambda c, x: ((c, c), None), jnp.ones(2), jnp.ones(3), mode=mode)
    _one_line(e)
    with pytest.raises(TypeError, match="same shapes and dtypes") as e:
        scan(lambda c, x: (c[:1] * x, None), jnp.ones(2), jnp.ones(3), mode=mode)
    _one_line(e)


@pytest.mark.skipif(
    UNDER_CUSTOM_VJP3, reason="JAX_CUSTOM_VJP3 raises its own forward-mode error"
)
@pytest.mark.parametrize("kind", KINDS)
def test_forward_mode_is_refused_in_one_line(kind):
    p = _params(jnp.float32)
    c = _init(kind, jnp.float32)

    def f(q):
        return _while(kind, p, (q, *c[1:]), 3, max_steps=5)

    for transform in (
        lambda: jax.jvp(f, (c[0],), (c[0],)),
        lambda: jax.jacfwd(f)(c[0]),
    ):
        with pytest.raises(TypeError, match="reverse mode only.*forward mode") as e:
            transform()
        _one_line(e)

    def g(q):
        return scan(lambda c, x: (_step(kind, p, c, x), None), (q, *c[1:]), jnp.ones(3))

    with pytest.raises(TypeError, match=r"revnet\.scan is differentiable in reverse"):
        jax.jvp(lambda q: g(q)[0][0], (c[0],), (c[0],))


# --------------------------------------------------------------------------- #
# A reference point: lax.scan under jax.checkpoint grows with max_steps.


def test_a_checkpointed_lax_scan_grows_with_max_steps_where_revnet_does_not():
    p = _params(jnp.float32, d=64)
    z = _init("damped", jnp.float32, batch=(16,), d=64)

    def bounded(max_steps):
        def loss(z):
            def f(c, _):
                z, i = c
                z2 = _step("damped", p, (z,))[0]
                return (jnp.where(i < 37, z2, z), i + 1), None

            (z, _), _ = lax.scan(jax.checkpoint(f), (z[0], 0), None, length=max_steps)
            return jnp.sum(jnp.sin(z))

        return jax.grad(loss)

    assert temp_bytes(bounded(4096), z) > 3 * temp_bytes(bounded(1024), z)


# --------------------------------------------------------------------------- #
# The comparison experiment counts every evaluation, whichever way it happens.


def test_the_comparison_counts_forward_recomputed_and_inverted_evaluations():
    from benchmarks import loops as lc

    params, q0 = lc.init(jax.random.PRNGKey(0), 8, 2)
    n, m = 8, 32

    def point(body, method):
        return lc.measure_point(body, method, n, m, params, q0, repeats=1)

    # Inverting: the forward step, then its inverse in the backward pass.
    assert point("invertible", "revnet")["body_evaluations"] == 2 * n
    assert point("partly invertible", "revnet")["body_evaluations"] == 2 * n
    # Checkpointing: forward, the schedule's recomputation, and the VJP's.
    slots = revolve.default_slots(m)
    want = n + _fewest(n, slots - 1) + n
    assert point("not invertible", "revnet")["body_evaluations"] == want
    assert point("invertible", "revnet checkpoint")["body_evaluations"] == want
    # jax.checkpoint over a bounded scan runs every one of max_steps twice.
    scan_row = point("not invertible", "checkpointed lax.scan")
    assert scan_row["body_evaluations"] == 2 * m
    assert point("not invertible", "unrolled")["body_evaluations"] == n
    assert point("not invertible", "revnet")["temp_bytes"] < scan_row["temp_bytes"]


def test_the_loops_guide_runs_in_the_modes_it_names():
    import pathlib
    import re

    readme = pathlib.Path(ROOT) / "docs" / "guides" / "loops.md"
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)
    code = next(b for b in blocks if "def leapfrog_max" in b)
    ns: dict = {}  # the block is self-contained (tests/project/test_docs.py)
    with modes_chosen() as seen:
        exec(compile(code, str(readme), "exec"), ns)  # noqa: S102
    # The three loops, then the leapfrog loop that the block differentiates.
    assert [m.kind for m in seen] == ["invert", "store", "checkpoint", "invert"]


# --------------------------------------------------------------------------- #
# mode=, and the deprecated invert=.


def _coupled(w, partial: bool):
    """An additive coupling step; ``partial`` adds a running maximum, which
    inversion cannot rebuild."""

    def step(c, x=0.0):
        x1, x2 = c[0], c[1]
        x1 = x1 + jnp.tanh(x2 * w[0]) + x
        x2 = x2 + jnp.sin(x1 * w[1])
        return (x1, x2, jnp.maximum(c[2], jnp.max(x1))) if partial else (x1, x2)

    return step


def _mode_losses(loop: str, partial: bool):
    """``(revnet loss, plain loss)`` of ``(init, w, xs)`` for one loop."""

    def init_of(x1, x2):
        return (x1, x2, jnp.zeros((), x1.dtype)) if partial else (x1, x2)

    def total(c, ys=0.0):
        return sum(jnp.sum(jnp.sin(v)) for v in c) + jnp.sum(ys)

    if loop == "while_loop":

        def ours(x1, x2, w, xs, mode):
            step = _coupled(w, partial)
            cond = lambda c: jnp.sum(c[0]) < 1e6  # noqa: E731
            out = while_loop(cond, step, init_of(x1, x2), max_steps=5, mode=mode)
            return total(out)

        def plain(x1, x2, w, xs):
            c = init_of(x1, x2)
            for _ in range(5):
                c = _coupled(w, partial)(c)
            return total(c)

        return ours, plain

    def scan_step(w):
        def f(c, x):
            c = _coupled(w, partial)(c, x)
            return c, jnp.sum(c[1] * x)

        return f

    def ours(x1, x2, w, xs, mode):
        return total(*scan(scan_step(w), init_of(x1, x2), xs, mode=mode))

    def plain(x1, x2, w, xs):
        return total(*lax.scan(scan_step(w), init_of(x1, x2), xs))

    return ours, plain


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("loop", ["while_loop", "scan"])
@pytest.mark.parametrize(
    "mode, partial",
    [("auto", False), ("invert", False), ("store", False), ("store", True)]
    + [("checkpoint", False)],
)
def test_every_mode_gives_autodiffs_gradient(mode, partial, loop, dtype):
    with jax.enable_x64(dtype == "float64"):
        key = jax.random.split(jax.random.PRNGKey(3), 4)
        x1, x2, w = (jax.random.normal(k, (3,), dtype) for k in key[:3])
        xs = 0.1 * jax.random.normal(key[3], (4, 3), dtype)
        ours, plain = _mode_losses(loop, partial)
        with modes_chosen() as seen:
            got = jax.grad(ours, (0, 1, 2, 3))(x1, x2, w, xs, mode)
        want = jax.grad(plain, (0, 1, 2, 3))(x1, x2, w, xs)
        kinds = {"auto": "invert", "invert": "invert", "checkpoint": "checkpoint"}
        assert seen[-1].kind == kinds.get(mode, "store" if partial else "invert")
        assert_trees_close(got, want, tolerance(dtype), what="gradient")


def test_store_on_an_unbounded_while_loop_is_refused():
    with pytest.raises(ValueError, match="max_steps.*mode='checkpoint'") as e:
        while_loop(lambda c: c < 3.0, lambda c: c + 1.0, 0.0, mode="store")
    _one_line(e)


def test_invert_mode_on_a_body_that_cannot_be_inverted():
    with pytest.raises(NotInvertibleError):
        scan(lambda c, x: (jnp.sin(c) * 0.0 + x, None), 1.0, jnp.ones(3), mode="invert")


def test_a_bad_mode_lists_the_four():
    with pytest.raises(ValueError, match="'auto', 'invert', 'store', 'checkpoint'"):
        scan(lambda c, x: (c + x, None), 1.0, jnp.ones(3), mode="inverted")


@pytest.mark.parametrize(
    "invert, kind, spelling",
    [(True, "invert", "invert"), (False, "checkpoint", "checkpoint")]
    + [(None, "invert", "auto")],
)
def test_invert_is_deprecated_and_maps_to_a_mode(invert, kind, spelling):
    def run(x):
        return scan(lambda c, x: (c + x, None), x, jnp.ones(3), invert=invert)[0]

    with modes_chosen() as seen:
        with pytest.warns(DeprecationWarning, match=f"mode='{spelling}'"):
            jax.eval_shape(run, 1.0)
        with pytest.warns(DeprecationWarning, match=f"mode='{spelling}'"):
            jax.eval_shape(
                lambda x: while_loop(
                    lambda c: c < 3.0, lambda c: c + 1.0, x, max_steps=4, invert=invert
                ),
                1.0,
            )
    assert [m.kind for m in seen] == [kind, kind]


def test_invert_and_mode_together_are_refused():
    with pytest.raises(TypeError, match="both invert= and mode="):
        scan(lambda c, x: (c + x, None), 1.0, jnp.ones(3), invert=True, mode="invert")
    with pytest.raises(TypeError, match="both invert= and mode="):
        while_loop(lambda c: c < 3.0, lambda c: c + 1.0, 0.0, mode="auto", invert=None)


def test_options_are_keyword_only():
    with pytest.raises(TypeError):
        while_loop(lambda c: c < 3.0, lambda c: c + 1.0, 0.0, 5)
    with pytest.raises(TypeError):
        scan(lambda c, x: (c + x, None), 1.0, jnp.ones(3), None, False, 1, 4)


def test_docstring_examples():
    import doctest

    import revnet

    result = doctest.testmod(loops, extraglobs={"jnp": jnp, "revnet": revnet})
    assert result.attempted > 0
    assert result.failed == 0


# --------------------------------------------------------------------------- #
# kinks= and decisions= in every mode, at an exact tie of a relu.

_TIE_W = [[0.7, 0.2, -0.3], [0.1, 0.9, 0.4], [-0.2, 0.3, 0.8]]
_TIE_STEPS = 12


def _relu_step(w):
    def step(c):
        a, b, i = c
        a = a + jax.nn.relu(b @ w)  # relu(0) at the first step when b is 0
        b = b + 0.7 * jnp.tanh(a @ w)
        return a, b, i + 1

    return step


def _relu_loss(out):
    a, b, _ = out
    return jnp.sum(a * jnp.arange(1.0, 4.0, dtype=a.dtype)) + jnp.sum(b**2)


def _relu_loop(loop, w, a, b, **kw):
    step, init = _relu_step(w), (a, b, 0)
    if loop == "scan":
        return scan(lambda c, _: (step(c), None), init, None, _TIE_STEPS, **kw)[0]
    bound = dict(max_steps=_TIE_STEPS + 10) if loop == "while_loop(max_steps)" else {}
    return while_loop(lambda c: c[2] < _TIE_STEPS, step, init, **kw, **bound)


def _relu_plain(w, a, b):
    step = _relu_step(w)
    return lax.scan(lambda c, _: (step(c), None), (a, b, 0), None, _TIE_STEPS)[0]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("decisions", ["store", "recompute"])
@pytest.mark.parametrize("kinks", ["store", "recompute"])
@pytest.mark.parametrize("mode", ["auto", "invert", "store", "checkpoint"])
@pytest.mark.parametrize("loop", ["while_loop", "while_loop(max_steps)", "scan"])
def test_kinks_and_decisions_in_every_mode(loop, mode, kinks, decisions, dtype):
    """kinks='store' gives jax.grad's derivative at a tie (relu'(0) = 0) in
    every mode that runs, whatever ``decisions`` is; a combination that cannot
    store per step is refused in one line naming the kink and what works."""
    with jax.enable_x64(dtype == "float64"):
        w = jnp.asarray(_TIE_W, dtype)
        a = jnp.asarray([0.31, -0.27, 0.13], dtype)
        b = jnp.zeros(3, dtype)

        def grads(fun, b):
            return jax.grad(lambda *p: _relu_loss(fun(*p)), (0, 1, 2))(w, a, b)

        kw = dict(mode=mode, kinks=kinks, decisions=decisions)
        ours = functools.partial(_relu_loop, loop, **kw)
        if loop == "while_loop" and mode == "store":
            with pytest.raises(ValueError, match="needs max_steps") as e:
                grads(ours, b)
            _one_line(e)
            return
        if loop == "while_loop" and mode == "invert" and kinks == "store":
            # Without max_steps there is no room for a kink per step.
            words = r"while_loop: a kink \(`custom_jvp_call` \(relu\) at .*test_modes"
            words += r".*give max_steps.*mode='checkpoint'.*kinks='recompute'"
            with pytest.raises(ValueError, match=words) as e:
                grads(ours, b)
            _one_line(e)
            return
        if kinks == "recompute" and mode != "checkpoint":
            # A recomputed kink follows the rebuilt value at a tie, on either
            # side (documented); away from ties it is jax.grad's derivative.
            b = b + jnp.asarray([0.05, -0.04, 0.03], dtype)
        assert_trees_close(
            grads(ours, b),
            grads(_relu_plain, b),
            tolerance(dtype, loops=True),
            what="gradient",
        )


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_decision_on_an_integer_counter_is_recomputed_not_stored(dtype):
    """An integer carry leaf (a step counter) is rebuilt exactly, so a jump
    read from it alone (a time slot: the counter as a float, cast back to an
    integer) is recomputed: the scan stores nothing per step, and the
    gradient is autodiff's."""

    def step(carry, w):
        i, x, y = carry
        t = i.astype(x.dtype) * 0.5  # a time from the counter, then a slot
        sign = jnp.where(t.astype(jnp.int32) % 2 == 0, 1.0, -1.0).astype(x.dtype)
        x = x + sign * jnp.tanh(y * w)
        y = y + jnp.sin(x)
        return (i + 1, x, y), None

    def loss(run, x, ws):
        (_, x, y), _ = run(step, (jnp.int32(0), x, x), ws)
        return jnp.sum(x * y)

    with jax.enable_x64(dtype == "float64"):
        x = jnp.linspace(-1.0, 1.0, 4, dtype=dtype)
        ws = jnp.linspace(0.2, 0.6, 20, dtype=dtype)
        inverted = functools.partial(scan, mode="invert")
        report = revnet.stored(functools.partial(loss, inverted), x, ws)
        assert not [e for e in report.entries if e.steps and e.kind != "xs"], report
        assert not report.by_kind().get("decision"), report.by_kind()
        got = jax.grad(functools.partial(loss, inverted), (0, 1))(x, ws)
        want = jax.grad(functools.partial(loss, lax.scan), (0, 1))(x, ws)
        assert_trees_close(got, want, tolerance(dtype, loops=True), "gradient")
