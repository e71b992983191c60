"""revnet.stored lists what is kept, and revnet warns when it grows
(_engine/decisions/residuals.py).

The report is checked against the compiled program: ``jax.jit`` of the
forward pass that returns ``jax.vjp``'s closure, whose leaves are exactly the
residuals the backward pass reads. Its outputs (``compiled.out_info``) must be
the report's values one to one, as a multiset of (shape, dtype), with no
value left to ``"other"``; and the compiled outputs' bytes
(``memory_analysis().output_size_in_bytes``) must be the report's total plus
at most the output tuple's table of pointers (8 bytes a leaf).
"""

from __future__ import annotations

import collections
import dataclasses
import doctest
import functools
import math
import warnings

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import revnet
from benchmarks import decisions as bd
from revnet import blocks
from revnet._engine import jaxpr as jx
from revnet._engine.decisions import residuals
from tests.engine import test_decisions as td
from tests.helpers import calls_of


@pytest.fixture(autouse=True)
def _warn_afresh():
    """Each test sees every source line warn once again."""
    residuals.forget_warnings()
    yield
    residuals.forget_warnings()


def _compiled_residuals(f, *args):
    """The outputs of the compiled forward pass that returns ``jax.vjp``'s
    closure, and the bytes the compiled program gives its outputs."""
    fwd = jax.jit(lambda *a: jax.vjp(f, *a)[1]).lower(*args).compile()
    outs = jax.tree_util.tree_leaves(fwd.out_info)
    return outs, fwd.memory_analysis().output_size_in_bytes


def _key(shape, dtype):
    return tuple(int(d) for d in shape), str(dtype)


def assert_report_is_compiled(report, f, *args, compiled=None):
    """``report`` lists exactly the tensors and bytes the compiled program keeps
    (``compiled``: :func:`_compiled_residuals` of ``f``, if known)."""
    outs, out_bytes = compiled or _compiled_residuals(f, *args)
    others = [e for e in report.entries if e.kind == residuals.OTHER]
    assert not others, f"values no revnet function reported: {others}"
    ours = collections.Counter(_key(e.shape, e.dtype) for e in report.entries)
    theirs = collections.Counter(_key(o.shape, o.dtype) for o in outs)
    assert ours == theirs, (ours - theirs, theirs - ours)
    total = sum(math.prod(o.shape) * o.dtype.itemsize for o in outs)
    assert report.total_bytes == total == sum(e.nbytes for e in report.entries)
    assert 0 <= out_bytes - report.total_bytes <= 8 * len(outs), (
        out_bytes,
        report.total_bytes,
    )


def _stack_fn(decide, depth, **options):
    ps, (a, b) = bd.params(depth), bd.inputs()

    def f(ps, a, b):
        return revnet.invertible(bd.stack(decide, ps), **options)(a, b)

    return f, (ps, a, b)


def _act(act):
    return lambda h, p: act(h)


def _where(h, p=None):
    return jnp.where(h > 0, h + 1, h)  # a decision: h + 1 and h differ at 0


WHERE_LINE = _where.__code__.co_firstlineno + 1


# -- the report against the compiled program ------------------------------- #


@pytest.mark.parametrize("name", list(bd.PROGRAMS))
def test_report_of_each_decision_program_is_the_compiled_residuals(name):
    depth = 4
    f, args = _stack_fn(bd.PROGRAMS[name], depth)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", revnet.StoredGrowthWarning)
        report = revnet.stored(f, *args)
    assert_report_is_compiled(report, f, *args)
    kinds = report.by_kind()
    assert set(kinds) == {"constant", "output", "decision", "checked input"}, kinds
    assert kinds["constant"] == sum(x.nbytes for x in jax.tree.leaves(args[0]))
    assert kinds["output"] == args[1].nbytes + args[2].nbytes
    # The boundary check keeps the input the backward pass rebuilds.
    assert kinds["checked input"] == args[1].nbytes + args[2].nbytes
    decided = [e for e in report.entries if e.kind == "decision"]
    assert len(decided) == 2  # one in F and one in G
    for e in decided:
        assert e.steps == depth and e.shape[0] == depth
        assert e.where.startswith(bd.__file__), e.where
        assert "inside scan" in e.reason
    # README's table: bytes stored per layer.
    per_layer = {
        "b > 0": 4096,
        "sign": 4096,
        "round": 16384,
        "argmax routing": 2048,
        "top-k gating": 4096,
        "one-hot dispatch": 2048,
    }
    assert sum(e.per_step for e in decided) == per_layer[name]


def test_report_of_a_decision_free_stack_is_the_compiled_residuals():
    for depth in (4, 16):
        f, args = _stack_fn(_act(jnp.tanh), depth)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = revnet.stored(f, *args)
        assert_report_is_compiled(report, f, *args)
        assert report.growing_bytes == 0
        assert set(report.by_kind()) == {"constant", "output", "checked input"}
        assert not [w for w in caught if w.category is revnet.StoredGrowthWarning]


@pytest.mark.slow
def test_report_of_the_moe_block_is_the_compiled_residuals():
    x = td._tied_tokens()
    depth = 4

    def fwd(x):
        return blocks.ReversibleSequence(td._moe_block, depth)(x)

    model = hk.without_apply_rng(hk.transform(fwd))
    params = jax.jit(model.init)(jax.random.key(0), x)
    with pytest.warns(revnet.StoredGrowthWarning, match="top_k|made at"):
        report = revnet.stored(model.apply, params, x)
    assert_report_is_compiled(report, model.apply, params, x)
    decided = [e for e in report.entries if e.kind == "decision"]
    # Top-2 indices, int32, per token and layer (as tests/engine/test_decisions.py).
    tokens = x.shape[0] * x.shape[1]
    assert [(e.dtype, e.steps, e.per_step) for e in decided] == [
        (jnp.dtype(jnp.int32), depth, tokens * td.TOP_K * 4)
    ]
    params_bytes = sum(p.nbytes for p in jax.tree.leaves(params))
    assert report.by_kind() == {
        "constant": params_bytes,
        "output": x.nbytes,
        "decision": depth * tokens * td.TOP_K * 4,
        "checked input": x.nbytes,  # kept by the boundary check
    }


def _step(c, w):
    x1, x2 = c
    x1 = x1 + jnp.tanh(x2 * w[0])
    x2 = x2 + jnp.tanh(x1 * w[1])
    return (x1, x2), jnp.mean(x2)


def _deciding_step(c, w):
    x1, x2 = c
    x1 = x1 + jnp.where(x2 * w[0] > 0, 1.0, -0.5)
    x2 = x2 + jnp.tanh(x1 * w[1])
    return (x1, x2), None


def _leapfrog(c, w):
    x, v, top = c
    v = v - 0.1 * jnp.sin(x) * w
    x = x + 0.1 * v
    return (x, v, jnp.maximum(top, jnp.max(x))), None


def _leap_body(c):
    return _leapfrog(c, 1.0)[0]


def _inv_body(c):
    x1, x2 = c
    x1 = x1 + jnp.tanh(x2)
    return x1, x2 + jnp.tanh(x1)


def _deciding_body(c):
    return _deciding_step(c, (1.0, 1.0))[0]


def _relu_body(c):
    x1, x2 = c
    x1 = x1 + jax.nn.relu(x2)
    return x1, x2 + jnp.tanh(x1)


INIT = (jnp.linspace(-1.0, 1.0, 3), jnp.zeros(3))
TOP = (jnp.ones(3), jnp.zeros(3), 0.0)
WS = jnp.ones((8, 2))
LOOPS = {
    "scan invert": (
        lambda i, w: revnet.scan(_step, i, w, mode="invert"),
        (INIT, WS),
        {"xs", "output", "ys", "checked input"},
    ),
    "scan checkpoint": (
        lambda i, w: revnet.scan(_step, i, w, mode="checkpoint"),
        (INIT, WS),
        {"xs", "initial carry"},
    ),
    "scan anchors": (
        lambda i, w: revnet.scan(_step, i, w, anchor_every=3),
        (INIT, WS),
        {"xs", "output", "ys", "anchor"},
    ),
    "scan decisions": (
        lambda i, w: revnet.scan(_deciding_step, i, w),
        (INIT, WS),
        {"xs", "output", "decision", "checked input"},
    ),
    "scan store": (
        lambda i, w: revnet.scan(_leapfrog, i, w, mode="store"),
        (TOP, jnp.ones(5)),
        {"xs", "output", "stored carry", "checked input"},
    ),
    "while store": (
        lambda i: revnet.while_loop(
            lambda c: c[2] < 2.0, _leap_body, i, max_steps=50, mode="store"
        ),
        (TOP,),
        {"trip count", "output", "stored carry", "checked input"},
    ),
    "while checkpoint": (
        lambda i: revnet.while_loop(lambda c: c[2] < 2.0, _leap_body, i),
        (TOP,),
        {"trip count", "initial carry"},
    ),
    "while anchors": (
        lambda i: revnet.while_loop(
            lambda c: c[0][0] < 5.0, _inv_body, i, max_steps=20, anchor_every=4
        ),
        (INIT,),
        {"trip count", "output", "anchor"},
    ),
    "while decisions": (
        lambda i: revnet.while_loop(
            lambda c: c[0][0] < 5.0, _deciding_body, i, max_steps=20
        ),
        (INIT,),
        {"trip count", "output", "decision", "checked input"},
    ),
    "while kinks": (
        lambda i: revnet.while_loop(
            lambda c: c[0][0] < 5.0,
            _relu_body,
            i,
            max_steps=20,
            kinks="store",
            decisions="recompute",
        ),
        (INIT,),
        {"trip count", "output", "kink", "checked input"},
    ),
    "invertible around revnet.scan": (
        lambda a, b: revnet.invertible(
            lambda a, b: revnet.scan(_deciding_step, (a, b), WS)[0]
        )(a, b),
        INIT,
        {"constant", "output", "decision", "checked input"},
    ),
}


@pytest.mark.parametrize("name", list(LOOPS))
def test_report_of_each_loop_mode_is_the_compiled_residuals(name):
    f, args, kinds = LOOPS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", revnet.StoredGrowthWarning)
        report = revnet.stored(f, *args)
    assert_report_is_compiled(report, f, *args)
    assert set(report.by_kind()) == kinds, report.by_kind()
    for e in report.entries:
        if e.kind == "stored carry":  # the running maximum, one per step
            assert e.shape == (e.steps,) and e.steps in (5, 50)
            assert "_leapfrog" in e.where, e.where
        if e.kind == "anchor":
            assert e.steps == (3 if name == "scan anchors" else 5)
        if e.kind in ("xs", "ys", "decision", "kink"):
            # A while loop's are stored in room for max_steps steps.
            want = {"scan store": 5, "while decisions": 20, "while kinks": 20}
            assert e.steps == want.get(name, 8)
        if name in ("while decisions", "while kinks"):
            assert e.kind != "decision" or e.shape == (20, 3), e.shape
            assert e.kind != "kink" or e.shape == (20, 3), e.shape


def test_report_of_a_vmapped_function_takes_the_batched_shapes():
    ws = jnp.ones((4, 3, 3))

    def layer(c, w):
        a, b = c
        return (a + jnp.where(b @ w > 0, 1.0, -1.0), b + jnp.tanh(a @ w)), None

    net = revnet.invertible(lambda a, b: jax.lax.scan(layer, (a, b), ws)[0])
    f, x = jax.vmap(net), jnp.ones((5, 2, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", revnet.StoredGrowthWarning)
        report = revnet.stored(f, x, x)
    assert_report_is_compiled(report, f, x, x)
    decided = [e for e in report.entries if e.kind == "decision"]
    assert [e.shape for e in decided] == [(4, 5, 2, 3)]


def test_jax_residuals_outside_revnet_are_other():
    f, args = _stack_fn(_act(jnp.tanh), 4)

    def loss(*args):
        return sum(jnp.sum(jnp.sin(o)) for o in f(*args))

    report = revnet.stored(loss, *args)
    others = [e for e in report.entries if e.kind == residuals.OTHER]
    # sin's derivative: cos of each output, saved by JAX.
    assert [(e.shape, e.kept_by) for e in others] == [((256, 8), "jax")] * 2
    outs, _ = _compiled_residuals(loss, *args)
    kept_bytes = sum(o.dtype.itemsize * math.prod(o.shape) for o in outs)
    assert report.total_bytes == kept_bytes


def test_the_comparison_can_fail():
    """A report missing one value, or a loop that records nothing, fails the
    check against the compiled program."""
    f, args = _stack_fn(_where, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", revnet.StoredGrowthWarning)
        report = revnet.stored(f, *args)
    compiled = _compiled_residuals(f, *args)
    assert_report_is_compiled(report, f, *args, compiled=compiled)
    for n in range(len(report.entries)):
        rest = report.entries[:n] + report.entries[n + 1 :]
        short = dataclasses.replace(
            report, entries=rest, total_bytes=sum(e.nbytes for e in rest)
        )
        with pytest.raises(AssertionError):
            assert_report_is_compiled(short, f, *args, compiled=compiled)
    g, loop_args, _ = LOOPS["scan store"]
    with residuals.hooks_off():  # the loop records nothing
        blind = revnet.stored(g, *loop_args)
        assert {e.kind for e in blind.entries} == {residuals.OTHER}
        with pytest.raises(AssertionError, match="no revnet function reported"):
            assert_report_is_compiled(blind, g, *loop_args)


# -- what the report says --------------------------------------------------- #


def test_report_reads_as_a_table_and_takes_structs_and_keywords():
    def net(a, b, scale):
        return revnet.invertible(bd.stack(_act(jnp.tanh), ps))(a * scale, b)

    ps = bd.params(2)
    x = jax.ShapeDtypeStruct((256, 8), jnp.float32)
    report = revnet.stored(net, x, x, scale=2.0)
    text = str(report)
    assert text.splitlines()[0] == (
        f"{len(report.entries)} values kept for the backward pass: "
        f"{report.total_bytes:,} bytes (0 grow with steps)"
    )
    assert "revnet.invertible at " in text and "test_stored.py" in text
    assert "kind" in text and "source line" in text and "[256,8]" in text
    # The scaling outside the invertible function keeps its scalar (JAX's).
    kinds = {e.kind for e in report.entries}
    assert kinds == {"constant", "output", "other", "checked input"}
    others = [(e.shape, e.nbytes) for e in report.entries if e.kind == "other"]
    assert others == [((), 4)]


def test_docstring_example_runs():
    tests = doctest.DocTestFinder().find(revnet.stored, globs={})
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", revnet.StoredGrowthWarning)
        for test in tests:
            runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted >= 5 and result.failed == 0


def test_recording_costs_nothing_and_changes_nothing():
    """Outside ``revnet.stored`` a hook with nothing growing returns before it
    looks at anything; and the hooks change no compiled program."""
    f, args = _stack_fn(_where, 2)

    def program():
        loss = lambda *a: sum(jnp.sum(o**2) for o in f(*a))  # noqa: E731
        return jax.jit(jax.grad(loss, (0, 1, 2))).lower(*args).as_text()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", revnet.StoredGrowthWarning)
        hooked = program()
        g, loop_args, _ = LOOPS["scan store"]
        hooked_loop = jax.jit(jax.grad(lambda *a: jnp.sum(g(*a)[0][0])))
        hooked_loop = hooked_loop.lower(*loop_args).as_text()
    with residuals.hooks_off():
        assert program() == hooked
        plain_loop = jax.jit(jax.grad(lambda *a: jnp.sum(g(*a)[0][0])))
        assert plain_loop.lower(*loop_args).as_text() == hooked_loop

    # The hooks look at the stack (jx.caller_site) inside revnet.stored ...
    flat, flat_args = _stack_fn(_act(jnp.tanh), 4)
    h, h_args, _ = LOOPS["scan invert"]
    with calls_of(jx.caller_site) as calls:
        revnet.stored(flat, *flat_args)
        revnet.stored(h, *h_args)
    # (The boundary check's reporter names each checked call's site too.)
    hooks = [c for c in calls if c != "reporter"]
    assert hooks == ["invertible", "loop"], calls
    # ... and not outside, where nothing grows.
    with calls_of(jx.caller_site) as calls:
        jax.grad(lambda *a: jnp.sum(flat(*a)[0]), (0, 1, 2))(*flat_args)
        jax.grad(lambda *a: jnp.sum(h(*a)[0][0]))(*h_args)
    assert [c for c in calls if c != "reporter"] == [], calls
    assert calls.count("reporter") == 2, calls


# -- the growth warning ----------------------------------------------------- #


def _grad(f, args):
    return jax.grad(lambda *a: sum(jnp.sum(o) for o in f(*a)), (0, 1, 2))(*args)


def _differentiate(f, args):
    """Traces ``f``'s forward pass for differentiation, and no further."""
    return jax.eval_shape(lambda *a: jax.vjp(f, *a)[1], *args)


def test_warning_fires_for_a_stack_that_stores_per_layer():
    f, args = _stack_fn(_where, 8)
    with pytest.warns(revnet.StoredGrowthWarning) as caught:
        _grad(f, args)
    (w,) = [w for w in caught if w.category is revnet.StoredGrowthWarning]
    # It points at the decision's own line, and says what to do.
    assert (w.filename, w.lineno) == (__file__, WHERE_LINE)
    text = str(w.message)
    assert f"{__file__}:{WHERE_LINE}" in text
    assert "2 decisions bool[256, 8]" in text
    assert "4,096 bytes per step" in text and "25% of one activation" in text
    assert "(8 steps)" in text and "decisions='recompute'" in text
    assert "revnet.invertible at " in text
    # It names the primitive, and says it jumps: recomputing may flip it.
    assert "of `gt`" in text and "`gt` jumps" in text


def test_warning_fires_again_for_each_program_that_stores_per_step():
    """Every compile that stores per step warns, not only the first in a
    process: the same line at 8, then 16 layers; then both again under
    ``jit``: the same messages, shown once under the "default" filter, as
    :mod:`warnings` shows repeats, and again under "always"."""
    seen = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for depth, wrap in ((8, None), (16, None), (8, jax.jit), (16, jax.jit)):
            f, args = _stack_fn(_where, depth)
            before = len(caught)
            (wrap or (lambda g: g))(functools.partial(_grad, f))(args)
            seen.append(
                [
                    str(w.message)
                    for w in caught[before:]
                    if w.category is revnet.StoredGrowthWarning
                ]
            )
    assert len(seen[0]) == 1 and "(8 steps)" in seen[0][0]
    assert len(seen[1]) == 1 and "(16 steps)" in seen[1][0]
    assert seen[2] == [] and seen[3] == []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # repeats too
        f, args = _stack_fn(_where, 8)
        _grad(f, args)
        _differentiate(jax.jit(f), args)
    assert len([w for w in caught if w.category is revnet.StoredGrowthWarning]) == 2


ACTIVATIONS = {"tanh": jnp.tanh, "relu": jax.nn.relu, "leaky_relu": jax.nn.leaky_relu}


@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_warning_is_silent_for_a_stack_that_stores_nothing_per_layer(act):
    f, args = _stack_fn(_act(ACTIVATIONS[act]), 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _grad(f, args)
        report = revnet.stored(f, *args)
    assert not [w for w in caught if w.category is revnet.StoredGrowthWarning]
    assert report.growing_bytes == 0


def test_warning_can_be_made_an_error_or_silenced():
    f, args = _stack_fn(_where, 4)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", category=revnet.StoredGrowthWarning)
        with pytest.raises(revnet.StoredGrowthWarning, match="decisions="):
            _differentiate(f, args)
        with pytest.raises(revnet.StoredGrowthWarning):  # raised again
            _differentiate(f, args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=revnet.StoredGrowthWarning)
        _differentiate(f, args)
    assert not caught
    assert issubclass(revnet.StoredGrowthWarning, UserWarning)


def test_warning_threshold_is_a_sixteenth_of_an_activation():
    """An int32 routing index per token of a stream of 2 x 32 float32 is 1/64
    of an activation: silent. Of 2 x 4 float32, 1/8: it warns."""
    assert residuals.GROWTH_FRACTION == 1 / 16
    for width, warns in ((32, False), (4, True)):
        residuals.forget_warnings()
        w_router = jnp.ones((4, width, 2)) / 8

        def net(a, b, w_router=w_router):
            def layer(c, w):
                a, b = c
                route = jnp.argmax(b @ w, -1)[:, None].astype(a.dtype)
                a = a + 0.1 * route
                return (a, b + jnp.tanh(a)), None

            return jax.lax.scan(layer, (a, b), w_router)[0]

        x = jnp.ones((16, width))
        f = revnet.invertible(net)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = revnet.stored(f, x, x)
        decided = [e for e in report.entries if e.kind == "decision"]
        assert sum(e.per_step for e in decided) == 16 * 4  # int32 per token
        mine = [w for w in caught if w.category is revnet.StoredGrowthWarning]
        assert bool(mine) == warns, (width, [str(w.message) for w in mine])


def test_warning_names_the_remedy_for_kinks_and_stored_carries():
    f, args = _stack_fn(_act(jax.nn.relu), 4, kinks="store")
    with pytest.warns(revnet.StoredGrowthWarning, match="kinks='store'"):
        _differentiate(f, args)
    g, loop_args, _ = LOOPS["scan store"]
    with pytest.warns(revnet.StoredGrowthWarning, match="mode='checkpoint'") as w:
        jax.grad(lambda *a: jnp.sum(g(*a)[0][0]))(*loop_args)
    assert "a carry leaf float32[]" in str(w[0].message)
    assert "_leapfrog" in str(w[0].message)
    # Anchors grow with steps by request: reported, never warned about.
    h, h_args, _ = LOOPS["scan anchors"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.grad(lambda *a: jnp.sum(h(*a)[0][0]))(*h_args)
    assert not [w for w in caught if w.category is revnet.StoredGrowthWarning]


def test_no_warning_without_differentiation():
    f, args = _stack_fn(_where, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.jit(f)(*args)
        functools.partial(f, args[0])(*args[1:])
    assert not caught
    assert np.isfinite(np.asarray(f(*args)[0])).all()
