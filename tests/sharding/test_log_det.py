"""``revnet.forward_and_log_det`` through ``jax.shard_map``.

The programs run on 8 forced CPU devices, a 2x4 mesh of axes ``data`` and
``model``, in float64: each group runs in a fresh subprocess (``_run``) and
prints ``ok``. Every log-determinant is compared with ``slogdet`` of
``jax.jacfwd`` of the global map (flattened; per example, the Jacobian's
diagonal blocks) at 1e-10 relative. The cases are chosen so that a term
counted once per device instead of once per distinct block would be wrong:
inputs replicated along an axis (``in_specs`` with ``P()`` there), a factor
replicated on every device scaling every block, and one matrix per device.
Refusals are one line naming the equation and its source line.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.helpers import run_python

pytestmark = pytest.mark.slow  # 8-device subprocesses

_PRELUDE = textwrap.dedent(
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import revnet
    from tests.helpers import tolerance

    jax.config.update("jax_enable_x64", True)
    assert jax.device_count() == 8, jax.device_count()
    EXPLICIT = jax.make_mesh((2, 4), ("data", "model"))
    assert EXPLICIT.axis_types == (AxisType.Explicit,) * 2
    AUTO = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    RING = [(i, (i + 1) % 4) for i in range(4)]
    DM = P("data", "model")


    def put(x, spec):
        return jax.device_put(x, NamedSharding(EXPLICIT, spec))


    def normal(seed, shape, scale=1.0):
        return scale * jax.random.normal(jax.random.key(seed), shape, jnp.float64)


    def mapped(body, in_specs, out_specs, *consts, **kw):
        '''x -> shard_map(body)(x, *consts).'''
        sm = jax.shard_map(body, in_specs=in_specs, out_specs=out_specs, **kw)
        return lambda *xs: sm(*xs, *consts)


    def global_view(f, xs):
        '''f on replicated, unsharded values (the Jacobian's reference).'''
        types = jax.sharding.get_abstract_mesh().axis_types
        explicit = AxisType.Explicit in types
        specs = [x.sharding.spec for x in xs]

        def g(*vs):
            if explicit:
                vs = [jax.sharding.reshard(v, s) for v, s in zip(vs, specs)]
            out = f(*vs)
            if explicit:
                out = jax.tree.map(lambda o: jax.sharding.reshard(o, P()), out)
            return out

        return g, [np.asarray(x) for x in xs]


    def whole_reference(f, *xs):
        '''slogdet(jacfwd) of the flattened global map.'''
        g, vs = global_view(f, xs)
        sizes = [v.size for v in vs]

        def flat(v):
            parts = jnp.split(v, np.cumsum(sizes)[:-1])
            args = [p.reshape(a.shape) for p, a in zip(parts, vs)]
            return jnp.concatenate([jnp.ravel(o) for o in jax.tree.leaves(g(*args))])

        v = np.concatenate([a.ravel() for a in vs])
        jac = np.asarray(jax.jit(jax.jacfwd(flat))(v))
        return np.linalg.slogdet(jac)[1]


    def per_example_reference(f, x):
        '''slogdet of each example's block of the Jacobian (batch axis 0).'''
        g, (v,) = global_view(f, [x])
        jac = np.asarray(jax.jit(jax.jacfwd(g))(v))
        return np.array([np.linalg.slogdet(jac[b, :, b, :])[1] for b in range(len(v))])


    def close(name, got, want):
        got, want = np.asarray(got), np.asarray(want)
        assert got.shape == want.shape, (name, got.shape, want.shape)
        err = float(np.max(np.abs(got - want) / np.maximum(1.0, np.abs(want))))
        assert err <= tolerance("float64", "log_det"), (name, got, want, err)
        print("checked", name)


    def check(name, f, *xs, batch_ndim=0, plain=None):
        '''revnet's log-det (under jit) against the reference (of ``plain``,
        the function without @revnet.invertible, if given).'''
        ld = jax.jit(
            lambda *xs: revnet.forward_and_log_det(f, *xs, batch_ndim=batch_ndim)[1]
        )(*xs)
        plain = plain or f
        if batch_ndim:
            close(name, ld, per_example_reference(plain, *xs))
        else:
            close(name, ld, whole_reference(plain, *xs))
        return ld


    def refused(name, f, x, words, batch_ndim=0):
        '''Refused in one line naming the equation and its source line.'''
        try:
            revnet.forward_and_log_det(f, x, batch_ndim=batch_ndim)
        except revnet.NotInvertibleError as e:
            msg = str(e)
        else:
            raise AssertionError(f"{name}: not refused")
        assert "\\n" not in msg and " at " in msg, (name, msg)
        for w in words:
            assert w in msg, (name, w, msg)
        print("refused", name, "--", msg)
    """
)


def _run(body: str) -> str:
    """Runs ``body`` after the prelude on 8 forced CPU devices; its stdout."""
    code = _PRELUDE + textwrap.dedent(body) + "\nprint('ok')\n"
    out = run_python("-c", code, devices=8, timeout=900)
    assert out.rstrip().endswith("ok"), out[-2000:]
    return out


def test_log_dets_through_shard_map():
    out = _run(
        """
        def affine(x, w):  # an affine coupling, its conditioner across model
            a, b = jnp.split(x, 2, -1)
            s = jnp.tanh(lax.ppermute(a, "model", RING) @ w)
            b = b * jnp.exp(s) + s
            a = a * jnp.exp(jnp.tanh(b @ w.T))
            return lax.ppermute(jnp.concatenate([a, b], -1), "model", RING)

        def exchanged(x):  # all_to_all over model on the feature axis
            a, b = jnp.split(x, 2, -1)
            b = b * jnp.exp(jnp.tanh(a))
            y = jnp.concatenate([a, b], -1)
            return lax.all_to_all(y, "model", 1, 1, tiled=True) * 1.5

        def tensor_parallel(x, w):  # a psum over known values in F
            a, b = jnp.split(x, 2, -1)
            b = b * jnp.exp(jnp.tanh(lax.psum(a @ w, "model")))
            return jnp.concatenate([a, b], -1)

        x0 = normal(0, (8, 16))
        w = normal(1, (2, 2), 0.5)
        w_dev = jnp.eye(4) + normal(2, (8, 4, 4), 0.3)  # one matrix per device
        w_rep = jnp.eye(16) + normal(3, (16, 16), 0.1)
        with jax.set_mesh(EXPLICIT):
            x = put(x0, DM)
            mats = put(w_dev, P(("data", "model")))
            per_shard = mapped(
                lambda x, w: jnp.sinh(x) @ w[0] * 1.5, (DM, P(("data", "model"))),
                DM, mats,
            )
            check("elementwise and a matrix per device", per_shard, x)
            check("... per example", per_shard, x, batch_ndim=1)
            coupling = mapped(affine, (DM, P()), DM, w)
            check("coupling split over model, ppermute", coupling, x)
            ld = check("... per example, batch over data", coupling, x, batch_ndim=1)
            assert ld.sharding.spec == P("data"), ld.sharding
            unchecked = mapped(affine, (DM, P()), DM, w, check_vma=False)
            check("... without check_vma, all split", unchecked, x)
            check("... without check_vma, per example", unchecked, x, batch_ndim=1)
            tp = mapped(tensor_parallel, (DM, P()), DM, w)
            check("psum over known values", tp, x)
            check("... per example", tp, x, batch_ndim=1)
            xe = put(normal(4, (4, 32)), DM)
            a2a = mapped(exchanged, DM, DM)
            check("all_to_all", a2a, xe)
            check("... per example", a2a, xe, batch_ndim=1)

            # A loop on Explicit-sharded values carries a log-det of one type.
            def loop(x):
                step = lambda h, _: (jnp.arcsinh(h) * 2.0, None)
                return lax.scan(step, x, None, length=3)[0]

            xd = put(x0, P("data"))
            check("a scan on a batch over data", loop, xd)
            check("... per example", loop, xd, batch_ndim=1)
            rev = revnet.invertible(loop)
            check("... inside invertible", rev, xd, plain=loop)
            check("... per example", rev, xd, batch_ndim=1, plain=loop)

            # Replicated: a term is counted once per distinct block, not once
            # per device holding a copy of it.
            replicated = mapped(
                lambda x, w: jnp.sinh(x) @ w * 0.7, (P("data"), P()), P("data"), w_rep
            )
            check("replicated over model", replicated, xd)
            xr = put(x0, P())
            everywhere = mapped(
                lambda x, w: jnp.sinh(x) @ w * 0.7, (P(), P()), P(), w_rep
            )
            check("replicated on every device", everywhere, xr)
            xm = put(x0, P(None, "model"))
            features = mapped(lambda x: jnp.sinh(x) * 2.0, P(None, "model"),
                              P(None, "model"))
            check("per example, the batch replicated", features, xm, batch_ndim=1)
            two = mapped(
                lambda x, z: (jnp.sinh(x) * 3.0, jnp.arcsinh(z) * 0.5),
                (DM, P("data")), (DM, P("data")),
            )
            check("two inputs, one replicated over model", two, x, xd)
            partial = mapped(
                lambda x: jnp.sinh(x) * 2.0, P("data"), P("data"), axis_names={"data"}
            )
            check("model left to the compiler (axis_names)", partial, x)
            check("... per example", partial, x, batch_ndim=1)
            # The transposed block layout permutes blocks: fine for the whole
            # map, not per example (refused below).
            transposed = mapped(lambda x: jnp.sinh(x) * 2.0, DM, P("model", "data"))
            check("blocks transposed", transposed, x)

        with jax.set_mesh(AUTO):
            x = jax.device_put(x0, NamedSharding(AUTO, DM))
            coupling = mapped(affine, (DM, P()), DM, w)
            check("Auto mesh: coupling", coupling, x)
            check("Auto mesh: per example", coupling, x, batch_ndim=1)
            xd = jax.device_put(x0, NamedSharding(AUTO, P("data")))
            replicated = mapped(
                lambda x, w: jnp.sinh(x) @ w * 0.7, (P("data"), P()), P("data"), w_rep
            )
            check("Auto mesh: replicated over model", replicated, xd)

        with jax.set_mesh(EXPLICIT):
            x, xd = put(x0, DM), put(x0, P("data"))
            gather = mapped(
                lambda x: lax.all_gather(jnp.sinh(x), "model", axis=1, tiled=True),
                DM, P("data"), check_vma=False,
            )
            refused("all_gather", gather, x, ["`all_gather`"])
            unknown_copies = mapped(
                lambda x: jnp.sinh(x), P("data"), P("data"), check_vma=False
            )
            refused(
                "without check_vma, replicated",
                unknown_copies, xd, ["`shard_map`", "check_vma"],
            )
            across = mapped(
                lambda x: lax.ppermute(jnp.sinh(x), "data", [(0, 1), (1, 0)]), DM, DM
            )
            check("ppermute over data", across, x)
            refused(
                "per example, ppermute over data",
                across, x, ["`ppermute`", "split the batch"], batch_ndim=1,
            )
            xs = put(normal(5, (16, 16)), DM)
            split_batch = mapped(
                lambda x: lax.all_to_all(jnp.sinh(x), "model", 0, 1, tiled=True),
                DM, DM,
            )
            refused(
                "per example, all_to_all on the batch axis",
                split_batch, xs, ["`all_to_all`", "mixes"], batch_ndim=1,
            )
            refused(
                "per example, blocks transposed",
                transposed, x, ["`shard_map`", "out_specs"], batch_ndim=1,
            )
            # Without a term there is nothing to count: accepted (zero).
            moved = mapped(
                lambda x: lax.ppermute(x, "model", RING) + 1.0, P("data"), P("data"),
                check_vma=False,
            )
            ld = revnet.forward_and_log_det(moved, xd)[1]
            assert float(ld) == 0.0, ld
        """
    )
    assert out.count("checked") == 25, out
    assert out.count("refused") == 5, out


def test_log_det_gradients_inside_invertible():
    """A scan of sharded couplings inside ``@revnet.invertible``: the log-det
    and its gradient (whole and per example) against ``jax.grad`` of the
    reference, in memory that does not grow with depth."""
    _run(
        """
        def layer(x, w):
            a, b = jnp.split(x, 2, -1)
            s = jnp.tanh(lax.ppermute(a, "model", RING) @ w)
            return jnp.concatenate([b * jnp.exp(s) + s, jnp.sinh(a) * 1.5], -1)

        def flow(ws, x):
            step = jax.shard_map(layer, in_specs=(DM, P()), out_specs=DM)
            return lax.scan(lambda h, w: (step(h, w), None), x, ws)[0]

        rev = revnet.invertible(flow, known_argnums=0)
        coef = jnp.arange(1.0, 9.0)

        def ours(ws, x, k):
            ld = revnet.forward_and_log_det(rev, ws, x, batch_ndim=k)[1]
            return jnp.sum(jnp.sin(ld) * (coef if k else 1.0))

        def theirs(ws, x, k):
            rs = jax.sharding.reshard
            g = lambda v: rs(flow(ws, rs(v, DM)), P())
            jac = jax.jacfwd(g)(rs(x, P()))
            if k:
                lds = jnp.stack(
                    [jnp.linalg.slogdet(jac[b, :, b, :])[1] for b in range(8)]
                )
            else:
                lds = jnp.linalg.slogdet(jac.reshape(x.size, x.size))[1]
            return jnp.sum(jnp.sin(lds) * (coef if k else 1.0))

        with jax.set_mesh(EXPLICIT):
            x = put(normal(0, (8, 16), 0.5), DM)
            ws = normal(1, (3, 2, 2), 0.3)
            for k in (0, 1):
                got = jax.jit(jax.value_and_grad(ours), static_argnums=2)(ws, x, k)
                want = jax.jit(jax.value_and_grad(theirs), static_argnums=2)(ws, x, k)
                close(f"value, batch_ndim={k}", got[0], want[0])
                close(f"gradient, batch_ndim={k}", got[1], want[1])

            def loss(ws, x):
                y, ld = revnet.forward_and_log_det(rev, ws, x, batch_ndim=1)
                return jnp.sum(y**2) - jnp.sum(ld)

            def temp(depth):
                wd = normal(1, (depth, 2, 2), 0.3)
                compiled = jax.jit(jax.grad(loss)).lower(wd, x).compile()
                return compiled.memory_analysis().temp_size_in_bytes

            shallow, deep = temp(4), temp(16)
            assert deep == shallow, (shallow, deep)
            print("temp bytes at depth 4 and 16:", shallow, deep)
        """
    )


def test_a_scanned_flow_storing_decisions_on_a_sharded_batch():
    """A leaky ReLU closing each scanned coupling: a decision per step and
    example, which the plan stores as a scan output ``[steps, batch, ...]``
    split as the batch is (over ``data``). Under ``@revnet.invertible`` the
    values and gradients equal plain autodiff's; the log-det, whole and per
    example, equals the reference's on an Explicit and an Auto mesh."""
    out = _run(
        """
        def flow(x):
            def layer(h, _):
                a, b = jnp.split(h, 2, -1)
                b = b * jnp.exp(jnp.tanh(a)) + a
                h = jnp.concatenate([b, a], -1)
                return jnp.where(h > 0, h, 0.5 * h), None

            return lax.scan(layer, x, None, length=3)[0]

        def loss(f):
            return lambda x: jnp.sum(jnp.sin(f(x)))

        x0 = normal(0, (8, 16))
        for mesh, spec in ((EXPLICIT, P("data")), (AUTO, P("data", "model"))):
            with jax.set_mesh(mesh):
                x = jax.device_put(x0, NamedSharding(mesh, spec))
                got = jax.jit(jax.value_and_grad(loss(revnet.invertible(flow))))(x)
                want = jax.jit(jax.value_and_grad(loss(flow)))(x)
                close("invertible: loss", got[0], want[0])
                close("invertible: gradient", got[1], want[1])
                check("log-det", flow, x)
                check("... per example", flow, x, batch_ndim=1)
                rev = revnet.invertible(flow)
                check("... inside invertible", rev, x, batch_ndim=1, plain=flow)
        """
    )
    assert out.count("checked") == 10, out
