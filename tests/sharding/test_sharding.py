"""revnet under ``jax.sharding``: Explicit and Auto meshes, ``shard_map``.

The programs run on 8 forced CPU devices, which must be set before JAX starts
a backend: each group runs in a fresh subprocess (``_run``) and prints ``ok``.
Every check compares ``revnet.invertible``'s gradients with plain
``jax.grad``'s, elementwise, AND their types: under Explicit axes a sharding
is part of an array's type (``f32[16@data,8]``), so each gradient leaf must
carry the sharding plain JAX gives it. ``revnet.inverse`` must give the input
back, with its sharding.

Avoided on purpose (a JAX issue, not revnet's): reverse mode under Explicit
sharding fails on a size-1 sharded axis (jax#35181); every sharded axis here
has size 2 or 4.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.helpers import run_python

pytestmark = pytest.mark.slow  # 8-device subprocesses

_PRELUDE = textwrap.dedent(
    """
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import revnet
    from tests.helpers import tolerance

    assert jax.device_count() == 8, jax.device_count()
    EXPLICIT = jax.make_mesh((4, 2), ("data", "model"))
    assert EXPLICIT.axis_types == (AxisType.Explicit,) * 2
    AUTO = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    assert AUTO.axis_types == (AxisType.Auto,) * 2
    RING = [(i, (i + 1) % 4) for i in range(4)]


    def leaves_type(tree):
        '''Each leaf's type and placement (its spec, one entry per axis).'''
        return [
            (str(jax.typeof(a)), (*a.sharding.spec, *[None] * a.ndim)[: a.ndim])
            for a in jax.tree.leaves(tree)
        ]


    def assert_same(name, got, want, dtype):
        '''Gradients equal elementwise (relative to each leaf's largest entry)
        and of the same types and placements.'''
        tol = tolerance(dtype, "sharded")
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            scale = max(1.0, float(jnp.max(jnp.abs(b))))
            err = float(jnp.max(jnp.abs(a - b)))
            assert err <= tol * scale, (name, "gradient", err)
        assert leaves_type(got) == leaves_type(want), (
            name, leaves_type(got), leaves_type(want)
        )


    def check(name, make_f, x, w, dtype="float32", jit=False, jit_reference=False):
        '''make_f(w) -> f(x); compares revnet with jax.grad in values and types
        (jit_reference: plain JAX's side alone under jit).'''

        def loss(x, w, rev):
            f = make_f(w)
            y = (revnet.invertible(f) if rev else f)(x)
            return sum(jnp.sum(jnp.sin(v)) for v in jax.tree.leaves(y)), y

        grad = jax.grad(loss, (0, 1), has_aux=True)
        if jit:
            grad = jax.jit(grad, static_argnums=2)
        want_grad = jax.jit(grad, static_argnums=2) if jit_reference else grad
        want, y = want_grad(x, w, False)
        got, y_rev = grad(x, w, True)
        assert_same(name, got, want, dtype)
        tol = tolerance(dtype, "sharded")
        for a, b in zip(jax.tree.leaves(y_rev), jax.tree.leaves(y)):
            assert float(jnp.max(jnp.abs(a - b))) <= tol, (name, "output")
        (back,) = revnet.inverse(make_f(w), x)(y)
        assert float(jnp.max(jnp.abs(back - x))) <= 10 * tol, (name, "inverse")
        assert leaves_type(back) == leaves_type(x), (
            name, leaves_type(back), leaves_type(x)
        )
        print("checked", name, dtype)


    def coupling(middle=lambda a: a, end=lambda a: a):
        '''a += tanh(b @ w); a = middle(a); b += sin(a @ w.T); concatenated.'''

        def make(w):
            def f(x):
                a, b = jnp.split(x, 2, axis=-1)
                a = a + jnp.tanh(b @ w)
                a = middle(a)
                b = b + jnp.sin(a @ w.T)
                return jnp.concatenate([end(a), b], -1)

            return f

        return make


    def data(mesh, dtype, spec=P("data", None)):
        x = jax.random.normal(jax.random.key(0), (16, 8), dtype)
        w = 0.3 * jax.random.normal(jax.random.key(1), (4, 4), dtype)
        return jax.device_put(x, NamedSharding(mesh, spec)), w
    """
)


def _run(body: str, prelude: str = _PRELUDE) -> str:
    """Runs ``body`` after ``prelude`` on 8 forced CPU devices; its stdout."""
    code = prelude + textwrap.dedent(body) + "\nprint('ok')\n"
    out = run_python("-c", code, devices=8, timeout=900)
    assert out.rstrip().endswith("ok"), out[-2000:]
    return out


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_coupling_on_a_default_explicit_mesh(dtype):
    out = _run(
        f"""
        dtype = "{dtype}"
        with jax.enable_x64(dtype == "float64"), jax.set_mesh(EXPLICIT):
            x, w = data(EXPLICIT, dtype)
            assert str(jax.typeof(x)).endswith("[16@data,8]")
            check("coupling", coupling(), x, w, dtype)
            check("coupling, jit", coupling(), x, w, dtype, jit=True)
            # Only the weights perturbed: x's zero cotangent is still sharded.
            g = jax.grad(lambda w: jnp.sum(revnet.invertible(coupling()(w))(x)))(w)
            assert jax.typeof(g) == jax.typeof(w)
            # reshard between the two halves, and back before concatenating.
            check(
                "reshard",
                coupling(
                    lambda a: jax.sharding.reshard(a, P("data", "model")),
                    lambda a: jax.sharding.reshard(a, P("data", None)),
                ),
                x, w, dtype,
            )
            # with_sharding_constraint asserts the sharding under Explicit axes.
            check(
                "with_sharding_constraint",
                coupling(lambda a: lax.with_sharding_constraint(a, P("data", None))),
                x, w, dtype,
            )
        """
    )
    assert out.count("checked") == 4


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_coupling_on_an_auto_mesh(dtype):
    out = _run(
        f"""
        dtype = "{dtype}"
        with jax.enable_x64(dtype == "float64"), jax.set_mesh(AUTO):
            x, w = data(AUTO, dtype)
            check("coupling", coupling(), x, w, dtype)
            wsc = coupling(
                lambda a: lax.with_sharding_constraint(a, P("data", "model"))
            )
            check("with_sharding_constraint", wsc, x, w, dtype)
            check("with_sharding_constraint, jit", wsc, x, w, dtype, jit=True)
        # A concrete mesh's NamedSharding, no mesh set.
        with jax.enable_x64(dtype == "float64"):
            x, w = data(AUTO, dtype)
            wsc = coupling(
                lambda a: lax.with_sharding_constraint(
                    a, NamedSharding(AUTO, P("data", "model"))
                )
            )
            check("with_sharding_constraint, no mesh set", wsc, x, w, dtype, jit=True)
        """
    )
    assert out.count("checked") == 4


def test_shard_map_couplings():
    out = _run(
        """
        # Eager shard_map compiles each primitive at each call: plain JAX's
        # reference runs under jit, revnet's side (unless jit=True) eagerly.
        check = functools.partial(check, jit_reference=True)

        def per_device(body, in_specs=(P("data"), P()), out_specs=P("data"), **kw):
            def make(w):
                return lambda x: jax.shard_map(
                    body, in_specs=in_specs, out_specs=out_specs, **kw
                )(x, w)
            return make

        def tensor_parallel(x, w):  # F's psum over known values: evaluated forward
            a, b = jnp.split(x, 2, axis=-1)
            cols = lax.dynamic_slice_in_dim(b, lax.axis_index("model") * 2, 2, 1)
            a = a + jnp.tanh(lax.psum(cols @ w, "model"))
            b = b + jnp.sin(lax.ppermute(a, "data", RING))
            return jnp.concatenate([a, b], -1)

        def stream_permuted(x, w):  # the stream itself: ppermute's rule
            a, b = jnp.split(x, 2, axis=-1)
            a = lax.ppermute(a + jnp.tanh(b @ w), "data", RING)
            b = b + jnp.sin(a @ w.T)
            return jnp.concatenate([a, b], -1)

        def gathered(tiled, axis):  # all_gather's rule: this device's slice
            def body(x, w):
                a, b = jnp.split(x, 2, axis=-1)
                a = a + jnp.tanh(b @ w)
                return lax.all_gather(a, "data", axis=axis, tiled=tiled), b
            return body

        def exchanged(x, w):  # all_to_all's rule: the exchange back
            a, b = jnp.split(x, 2, axis=-1)
            a = a + jnp.tanh(b @ w)
            b = b + jnp.sin(a @ w.T)
            return lax.all_to_all(a, "data", 0, 1, tiled=True), b

        def varied(x, w):  # pvary's rule: back to invariant along model
            a, b = jnp.split(x, 2, axis=-1)
            a = lax.pcast(a + jnp.tanh(b @ w), "model", to="varying")
            return a, b

        for dtype in ("float32", "float64"):
            # Eagerly in float32; under jit in float64 (CI's time: each eager
            # shard_map call compiles every primitive again).
            chk = functools.partial(check, jit=dtype == "float64")
            with jax.enable_x64(dtype == "float64"), jax.set_mesh(EXPLICIT):
                x, w = data(EXPLICIT, dtype)
                wm = jax.device_put(w, NamedSharding(EXPLICIT, P("model", None)))
                chk(
                    "psum and ppermute in F",
                    per_device(tensor_parallel, (P("data"), P("model"))),
                    x, wm, dtype,
                )
                chk("ppermute", per_device(stream_permuted), x, w, dtype)
                chk(
                    "ppermute, jit", per_device(stream_permuted), x, w, dtype, jit=True
                )
                two = (P(None, "data"), P("data"))
                for tiled, axis in ((True, 0), (False, 1)):
                    chk(
                        f"all_gather tiled={tiled}",
                        per_device(gathered(tiled, axis), out_specs=two),
                        x, w, dtype,
                    )
                chk(
                    "all_gather without check_vma",
                    per_device(
                        gathered(True, 0), out_specs=(P(), P("data")), check_vma=False
                    ),
                    x, w, dtype,
                )
                chk(
                    "all_to_all",
                    per_device(exchanged, out_specs=(P("data"), P("data"))),
                    x, w, dtype,
                )
                chk(
                    "pvary",
                    per_device(varied, out_specs=(P("data", "model"), P("data"))),
                    x, w, dtype,
                )
        """
    )
    assert out.count("checked") == 2 * 8


def test_invertible_inside_a_shard_map_body():
    _run(
        """
        for dtype in ("float32", "float64"):
            with jax.enable_x64(dtype == "float64"), jax.set_mesh(EXPLICIT):
                x, w = data(EXPLICIT, dtype)

                def loss(x, w, rev):
                    def body(x, w):  # w: the body's own (replicated) block
                        def f(x):
                            a, b = jnp.split(x, 2, axis=-1)
                            a = a + jnp.tanh(b @ w)
                            b = b + jnp.sin(lax.ppermute(a, "data", RING) @ w.T)
                            return jnp.concatenate([a, b], -1)

                        return (revnet.invertible(f) if rev else f)(x)

                    y = jax.shard_map(
                        body, in_specs=(P("data"), P()), out_specs=P("data")
                    )(x, w)
                    return jnp.sum(jnp.sin(y))

                want = jax.grad(loss, (0, 1))(x, w, False)
                got = jax.grad(loss, (0, 1))(x, w, True)
                for a, b in zip(got, want):
                    assert float(jnp.max(jnp.abs(a - b))) <= tolerance(dtype, "sharded")
                assert leaves_type(got) == leaves_type(want)
        """
    )


def test_partial_ppermute_is_refused_naming_sharding():
    _run(
        """
        with jax.set_mesh(EXPLICIT):
            x, w = data(EXPLICIT, "float32")

            def body(x, w):  # device 0 receives nothing: its block is lost
                return lax.ppermute(x * 2.0, "data", [(0, 1), (1, 2), (2, 3)])

            f = lambda x: jax.shard_map(
                body, in_specs=(P("data"), P()), out_specs=P("data")
            )(x, w)
            try:
                revnet.invertible(f)(x)
            except revnet.NotInvertibleError as e:
                assert "sharding axis" in str(e) and "ppermute" in str(e), str(e)
            else:
                raise AssertionError("not refused")
        """
    )


def test_a_step_counter_in_the_carry_inverts_under_jit_on_an_explicit_mesh():
    """A counter or clock in the carry is a replicated scalar: the inverse of its
    ``+ 1`` gives it ``P()`` on the mesh, where the program had no mesh at all.
    Both are the same placement, so the loop inverts (nothing stored) under
    ``jit`` as it does eagerly. A rule giving a sharding that truly differs is
    still refused, naming both."""
    _run(
        """
        def coupled(inc):
            def step(c, _):
                a, b, t = c
                a = a + jnp.tanh(b) * (1 + 0.1 * t)
                b = b + jnp.sin(a)
                return (a, b, t + inc), None
            return step

        for dtype in ("float32", "float64"):
            with jax.enable_x64(dtype == "float64"), jax.set_mesh(EXPLICIT):
                x, _ = data(EXPLICIT, dtype)
                for start, inc in ((0, 1), (jnp.int32(0), 1), (0.0, 0.1)):
                    step = coupled(inc)

                    def loss(x, scan, **kw):
                        (a, b, _), _ = scan(step, (x, x, start), None, length=5, **kw)
                        return jnp.sum(jnp.sin(a)) + jnp.sum(b**2)

                    def while_loss(x):
                        c = revnet.while_loop(
                            lambda c: c[2] < 4.5 * inc,
                            lambda c: step(c, None)[0],
                            (x, x, start),
                            mode="invert",
                        )
                        return jnp.sum(jnp.sin(c[0])) + jnp.sum(c[1] ** 2)

                    name = f"counter {start!r} + {inc}"
                    kept = revnet.stored(functools.partial(loss, scan=revnet.scan), x)
                    per_step = [(e.kind, e.shape) for e in kept.entries if e.steps]
                    assert per_step == [], (name, per_step)
                    want = jax.jit(jax.grad(loss), static_argnums=1)(x, lax.scan)
                    for mode in ("invert", "auto"):
                        got = jax.jit(jax.grad(functools.partial(loss, mode=mode)),
                                      static_argnums=1)(x, revnet.scan)
                        assert_same(f"{name}, scan {mode}", got, want, dtype)
                    got = jax.jit(jax.grad(while_loss))(x)
                    assert_same(f"{name}, while_loop", got, want, dtype)
                    print("checked", name, dtype)

        # The engine casts what a rule returns to the input's type, except to
        # "no explicit sharding" (a value made off the mesh, here under jit):
        # a replicated result is that placement, one split over data is not.
        def sinh_to(spec):
            def rule(outs, ins, **params):
                return [jax.sharding.reshard(jnp.arcsinh(outs[0]), spec)]
            return rule

        def step(c, _):
            a, b = c
            return (jnp.sinh(a) + b, b), None

        def loss(x, scan, **kw):
            return jnp.sum(scan(step, (x, x), None, length=2, **kw)[0][0])

        def grad(x, scan):  # traced anew at each call: the rule is read again
            return jax.jit(jax.grad(loss), static_argnums=1)(x, scan)

        x = 0.1 * jnp.ones((16, 8))
        invert = functools.partial(revnet.scan, mode="invert")
        with jax.set_mesh(EXPLICIT):
            assert "@" not in str(jax.typeof(x))
            want = grad(x, lax.scan)
            revnet.register_inverse("sinh", sinh_to(P()))
            assert_same("replicated rule", grad(x, invert), want, "float32")
            revnet.register_inverse("sinh", sinh_to(P("data")))
            try:
                grad(x, invert)
            except revnet.NotInvertibleError as e:
                words = "P('data', None) for an input of sharding no explicit"
                assert words in str(e) and "`sinh`" in str(e), str(e)
            else:
                raise AssertionError("a rule's P('data') was not refused")
        """
    )


def test_loop_buffers_of_sharded_steps_in_every_mode():
    """Buffers a loop fills one step at a time (the ``xs`` cotangent under
    ``mode="checkpoint"``, a while loop's stored leaves and stored decisions)
    have the sharding of the rows written into them, and the ``xs`` cotangent
    plain JAX's."""
    _run(
        """
        def coupled(c, x):
            a, b = c
            a = a + jnp.tanh(b + x)
            b = b + 0.5 * jnp.sin(a)
            return (a, b), jnp.sin(b) * x

        def with_max(c):  # m, a running maximum, is stored at every step
            a, b, m, i = c
            (a, b), _ = coupled((a, b), 0.1)
            return a, b, jnp.maximum(m, a), i + 1

        def with_round(c):  # a decision on the carry, stored at every step
            a, b, m, i = c
            a = a + jnp.round(4 * jnp.tanh(b)) / 4 + 0.1 * jnp.tanh(b)
            return a, b + jnp.tanh(a), m, i + 1

        scans = (
            dict(mode="checkpoint"),
            dict(mode="checkpoint", checkpoints=2),
            dict(mode="checkpoint", reverse=True),
            dict(mode="store"),
            dict(mode="invert"),
            dict(mode="invert", reverse=True),
            dict(mode="auto"),
            dict(mode="invert", anchor_every=2),
        )
        whiles = (
            dict(mode="checkpoint"),
            dict(mode="store", max_steps=7),
            dict(mode="auto", max_steps=7),
            dict(mode="checkpoint", max_steps=7, checkpoints=2),
        )

        def loss(x, xs, scan, **kw):
            (a, b), ys = scan(coupled, (x, x), xs, **kw)
            return jnp.sum(jnp.sin(a)) + jnp.sum(b**2) + jnp.sum(ys**2)

        def while_loss(x, loop):
            a, b, m, _ = loop((x, x, x, 0))
            return jnp.sum(jnp.sin(a)) + jnp.sum(b**2) + jnp.sum(m)

        def five_steps(c, body=with_max):
            return lax.scan(lambda c, _: (body(c), None), c, None, length=5)[0]

        for dtype in ("float32", "float64"):
            # Eagerly in float32, under jit in float64.
            jit = jax.jit if dtype == "float64" else lambda f, **kw: f
            with jax.enable_x64(dtype == "float64"), jax.set_mesh(EXPLICIT):
                x, _ = data(EXPLICIT, dtype)
                xs = jax.random.normal(jax.random.key(2), (5, 16, 8), dtype)
                xs = jax.device_put(xs, NamedSharding(EXPLICIT, P(None, "data")))
                assert str(jax.typeof(xs)).endswith("[5,16@data,8]")
                for kw in scans:
                    reverse = kw.get("reverse", False)
                    plain = functools.partial(lax.scan, reverse=reverse)
                    grad = jit(jax.grad(loss, (0, 1)), static_argnums=2)
                    want = grad(x, xs, plain)
                    got = grad(x, xs, functools.partial(revnet.scan, **kw))
                    assert_same(f"scan {kw}", got, want, dtype)
                grad = jit(jax.grad(while_loss), static_argnums=1)
                want = grad(x, five_steps)
                for kw in whiles:
                    cond = lambda c: c[3] < 5
                    ours = functools.partial(revnet.while_loop, cond, with_max, **kw)
                    got = grad(x, ours)
                    assert_same(f"while_loop {kw}", got, want, dtype)
                want = grad(x, functools.partial(five_steps, body=with_round))
                for mode in ("invert", "store", "auto"):
                    ours = functools.partial(
                        revnet.while_loop, cond, with_round, mode=mode, max_steps=7
                    )
                    assert_same(f"decisions, {mode}", grad(x, ours), want, dtype)
                print("checked", dtype)
        """
    )
