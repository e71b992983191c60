"""The classification of equations on rebuilt values (_engine/decisions/continuity.py).

The table must name every primitive JAX has, and what it says must hold of
the primitives themselves: a primitive classed smooth or kink moves its result
by little when its input moves by little, and a primitive classed as a
decision has a jump somewhere. Selects are classed from the program: a select
whose cases agree where its predicate switches is a kink.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend import core as jex_core
from jax.extend.core import primitives
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import revnet
from revnet._engine import expose, registry, trace
from revnet._engine.decisions import continuity as cont
from tests.helpers import primitives as traced_primitives
from tests.helpers import tolerance


def _jax_primitive_names() -> set[str]:
    return {
        p.name for p in vars(primitives).values() if isinstance(p, jex_core.Primitive)
    }


def test_each_rule_declares_its_class_where_it_is_registered():
    """One place per primitive: every built-in inverse rule's primitive has
    the continuity class declared with it (``define``), and a second
    declaration of any primitive is refused."""
    rules = [n for n in registry.names() if not registry.get(n).structural]
    assert len(rules) > 40, rules
    undeclared = [n for n in rules if registry.continuity(n) is None]
    assert not undeclared, undeclared
    assert registry.continuity("exp") == cont.SMOOTH
    assert registry.continuity("convert_element_type") == cont.DECISION
    with pytest.raises(ValueError, match="exp is declared smooth already"):
        registry.declare_continuity(["exp"], cont.SMOOTH)
    with pytest.raises(ValueError, match="continuity must be one of"):
        registry.declare_continuity(["a_new_primitive"], "wiggly")
    assert registry.continuity("a_new_primitive") is None


def test_every_jax_primitive_has_a_class():
    """The coverage table: every primitive ``jax.extend`` lists, with its class
    (printed with ``pytest -s``)."""
    names = _jax_primitive_names()
    assert len(names) > 150  # the list is really there
    table = cont.table()
    missing = sorted(names - set(table))
    assert not missing, f"primitives without a class: {missing}"
    by_class: dict[str, list[str]] = {}
    for n in sorted(names):
        by_class.setdefault(table[n], []).append(n)
    for cls, ns in sorted(by_class.items()):
        print(f"{cls} ({len(ns)}): {' '.join(ns)}")
    assert set(by_class) <= {
        cont.SMOOTH,
        cont.KINK,
        cont.DECISION,
        cont.GUARD,
        cont.STRUCTURAL,
    }


def _collectives(x, w):
    a = lax.psum(x, "i") + lax.pmean(x, "i") + lax.pmax(x, "i") + lax.pmin(x, "i")
    b = lax.all_gather(x, "i", tiled=True) + lax.psum_scatter(x, "i", tiled=True)
    c = lax.ppermute(x, "i", [(0, 0)]) + lax.all_to_all(x, "i", 0, 0, tiled=True)
    return a + b + c + lax.pcast(w, "i", to="varying") * lax.axis_index("i")


def _references(x):
    r = jax.new_ref(jnp.zeros_like(x))
    r[...] = x * 2
    r[...] += x
    return jax.ref.freeze(r)


def test_primitives_found_only_in_traced_programs_have_their_class():
    """``jax.extend`` does not list every primitive a program binds: the
    collectives of a ``shard_map`` body under ``check_vma`` (``psum`` becomes
    ``psum_invariant``) and mutable references are found by tracing."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("i",))
    sharded = jax.shard_map(
        _collectives, mesh=mesh, in_specs=(P("i"), P()), out_specs=P("i")
    )
    x = jnp.ones(4)
    names = traced_primitives(sharded, x, x) | traced_primitives(_references, x)
    assert {"psum_invariant", "reduce_scatter", "new_ref", "freeze"} <= names
    table = cont.table()
    assert not sorted(names - set(table)), sorted(names - set(table))
    smooth = {"psum_invariant", "reduce_scatter", "all_gather", "all_to_all"}
    assert {table[n] for n in smooth | {"ppermute", "pvary"}} == {cont.SMOOTH}
    assert {table[n] for n in ("pmax", "pmin")} == {cont.KINK}
    assert {table[n] for n in ("new_ref", "freeze", "get", "swap")} == {cont.STRUCTURAL}


def test_a_linear_primitive_the_table_does_not_name_is_smooth():
    """``stack`` (``jnp.stack``) is in no list ``jax.extend`` gives: JAX can
    transpose it, so it is smooth by rule; an unlisted primitive that is not
    linear (a product of its two inputs) stays a decision."""

    def stacked(a, b):
        return jnp.stack([a, 2.0 * b], axis=1)

    closed = jax.make_jaxpr(stacked)(jnp.ones(3), jnp.ones(3))
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "stack"]
    assert "stack" not in cont.table()
    assert cont.linear(eqn) and cont.classify(eqn) == cont.SMOOTH
    mul = jex_core.Primitive("product_of_two_unlisted")
    mul.def_impl(lambda a, b: a * b)
    mul.def_abstract_eval(lambda a, b: a)
    prog = jax.make_jaxpr(lambda a, b: mul.bind(a, b))(jnp.ones(3), jnp.ones(3))
    (eqn,) = prog.jaxpr.eqns
    assert not cont.linear(eqn) and cont.classify(eqn) == cont.DECISION


def test_a_decision_on_a_value_written_to_a_reference_is_stored():
    def f(x):
        return jnp.floor(_references(x))

    closed = jax.make_jaxpr(f)(jnp.ones(3))
    assert [k.primitive for k in expose(closed.jaxpr, [True]).kept] == ["floor"]


def test_an_unknown_primitive_is_a_decision():
    assert cont.primitive_class("some_future_primitive") == cont.DECISION


# Domains where each elementwise primitive is defined and finite.
_DOMAIN = {
    "log": (0.1, 3.0),
    "log2": (0.1, 3.0),
    "log1p": (-0.5, 3.0),
    "sqrt": (0.1, 3.0),
    "rsqrt": (0.1, 3.0),
    "acosh": (1.1, 3.0),
    "atanh": (-0.9, 0.9),
    "asin": (-0.9, 0.9),
    "acos": (-0.9, 0.9),
    "erf_inv": (-0.9, 0.9),
    "lgamma": (0.1, 3.0),
    "digamma": (0.1, 3.0),
    "tan": (-1.2, 1.2),
    "pow": (0.1, 3.0),
    "div": (0.1, 3.0),
    "rem": (0.1, 3.0),
    "atan2": (-3.0, 3.0),
}


def _elementwise_cases():
    """Every float->float elementwise primitive of one or two operands that
    ``jax.lax`` binds directly, found by probing, with its class."""
    cases = []
    for name in sorted(_jax_primitive_names()):
        prim = next(
            p
            for p in vars(primitives).values()
            if isinstance(p, jex_core.Primitive) and p.name == name
        )
        for arity in (1, 2):
            x = jnp.full((3,), 0.5, jnp.float64)
            try:
                out = prim.bind(*[x] * arity, **_params(name))
            except Exception:
                continue
            if prim.multiple_results or getattr(out, "shape", None) != (3,):
                continue
            if out.dtype != jnp.float64:
                continue
            cases.append((name, prim, arity))
            break
    return cases


def _params(name):
    return {
        "reduce_precision": {"exponent_bits": 4, "mantissa_bits": 3},
        "integer_pow": {"y": 3},
        "exp": {"accuracy": None},
        "exp2": {"accuracy": None},
        "log": {"accuracy": None},
        "log1p": {"accuracy": None},
        "expm1": {"accuracy": None},
        "tanh": {"accuracy": None},
        "logistic": {"accuracy": None},
        "sin": {"accuracy": None},
        "cos": {"accuracy": None},
        "tan": {"accuracy": None},
        "sqrt": {"accuracy": None},
        "rsqrt": {"accuracy": None},
        "cbrt": {"accuracy": None},
        "copy_p": {},
    }.get(name, {})


def test_the_table_holds_of_the_elementwise_primitives():
    """On a fine grid, a smooth or kink primitive's largest step between
    neighbours is of the grid's size; a decision's is not (it jumps).

    Probed in float64 on 20,001 points of each primitive's domain: the
    classification is checked against what the primitive computes."""
    h = 1e-4
    with jax.enable_x64(True):
        cases = _elementwise_cases()
        assert len(cases) >= 40
        for name, prim, arity in cases:
            lo, hi = _DOMAIN.get(name, (-3.0, 3.0))
            x = jnp.linspace(lo, hi, 20_001, dtype=jnp.float64)
            args = [x] if arity == 1 else [x, jnp.full_like(x, 0.7)]
            try:
                y = np.asarray(prim.bind(*args, **_params(name)))
            except Exception:
                continue
            if not np.all(np.isfinite(y)):
                continue
            step = float(np.max(np.abs(np.diff(y))))
            cls = cont.primitive_class(name)
            if cls in (cont.SMOOTH, cont.KINK):
                assert step < 1e3 * h, (name, cls, step)
            elif name in ("sign", "round", "floor", "ceil", "rem"):
                assert step > 1e2 * h, (name, cls, step)
    names = {n for n, _, _ in cases}
    assert {"exp", "tanh", "max", "abs", "rem", "floor", "sign"} <= names


def test_reduce_precision_and_narrowing_casts_are_decisions():
    x = jnp.linspace(-1.0, 1.0, 10_001, dtype=jnp.float32)
    y = lax.reduce_precision(x, exponent_bits=4, mantissa_bits=3)
    assert float(jnp.max(jnp.abs(jnp.diff(y)))) > 1e-2  # it jumps
    (eqn,) = jax.make_jaxpr(lambda x: lax.reduce_precision(x, 4, 3))(x).eqns
    assert cont.classify(eqn) == cont.DECISION

    def kinds(dtype_in, dtype_out):
        j = jax.make_jaxpr(lambda x: x.astype(dtype_out))(jnp.ones(3, dtype_in))
        return cont.classify(j.eqns[0])

    assert kinds(jnp.float32, jnp.bfloat16) == cont.DECISION
    assert kinds(jnp.float32, jnp.float16) == cont.DECISION
    assert kinds(jnp.float32, jnp.int32) == cont.DECISION
    assert kinds(jnp.bfloat16, jnp.float32) == cont.SMOOTH
    assert kinds(jnp.float16, jnp.float32) == cont.SMOOTH


def _n_stored(f, *args, **options):
    jaxpr, consts, _ = trace(f, list(args))
    rebuilt = [False] * len(consts) + [True] * len(args)
    return expose(jaxpr, rebuilt, **options)


_X = jnp.linspace(-2.0, 2.0, 12).reshape(3, 4)


def _layer_norm(h):
    """A LayerNorm of a narrow ``h`` computed in float32, returned narrow."""
    u = h.astype(jnp.float32)
    u = (u - jnp.mean(u, -1, keepdims=True)) * lax.rsqrt(jnp.var(u, -1) + 1e-5)[
        ..., None
    ]
    return u.astype(h.dtype)


def _bf16_mean_scaled(h):
    """``jnp.mean`` of a narrow ``h`` (accumulated in float32) times ``h``."""
    return jnp.tanh(jnp.mean(h, -1, keepdims=True) * h)


@pytest.mark.parametrize(
    "act",
    [
        jax.nn.leaky_relu,
        jax.nn.elu,
        jax.nn.selu,
        jax.nn.celu,
        jax.nn.hard_tanh,
        jax.nn.relu6,
        jax.nn.hard_sigmoid,
        jax.nn.hard_swish,
        jax.nn.softplus,
        jax.nn.mish,
        jax.nn.gelu,
        jax.nn.silu,
        lambda x: jnp.clip(x, -1.0, 1.0),
        lambda x: jnp.where(x == 0.0, 0.0, x),  # -0.0 normalised
        lambda x: jnp.where(jnp.isnan(x), 0.0, x),  # a guard
        lambda x: jnp.where(jnp.isfinite(x), x, 0.0),  # a guard
        lambda x: jnp.where(x > 1.0, 2.0 * x - 1.0, x * x),  # agree at 1
        jax.grad(lambda x: jnp.sum(jax.nn.softplus(x))),
        # A compute_dtype policy: rounding into a bfloat16 computation.
        lambda x: jnp.tanh(x.astype(jnp.bfloat16)).astype(x.dtype),
        # ... that widens on the way and rounds back (a float32 LayerNorm).
        lambda x: _layer_norm(x.astype(jnp.bfloat16)).astype(x.dtype),
        lambda x: _bf16_mean_scaled(x.astype(jnp.bfloat16)).astype(x.dtype),
    ],
)
def test_continuous_selects_guards_and_policy_casts_store_nothing(act):
    def f(a, b):
        return a + act(b), b

    assert _n_stored(f, _X, _X).n == 0


@pytest.mark.parametrize(
    "act",
    [
        lambda x: jnp.where(x > 0.0, x + 1.0, x),  # a jump of 1
        lambda x: jnp.where(x > 0.0, jnp.tanh(x), 0.0 * x + 0.1),
        lambda x: jnp.where(x > 1.0, x, x * x * x - 0.5),  # 1 vs 0.5
        lambda x: jnp.where(x > _X, x, 2.0 * x),  # threshold not constant
        lambda x: (x > 0).astype(x.dtype) * x + (x > 0),  # a mask used as a value
        lambda x: jnp.mod(x, 0.5),
        lambda x: jnp.round(x),
        lambda x: lax.reduce_precision(x, 4, 3),
        lambda x: x.astype(jnp.bfloat16).astype(x.dtype),
        # Widened and rounded back, but also read in float32: quantisation.
        lambda x: (
            _layer_norm(x.astype(jnp.bfloat16)).astype(x.dtype)
            + x.astype(jnp.bfloat16).astype(x.dtype)
        ),
        lambda x: jnp.take(jnp.arange(5.0), jnp.searchsorted(jnp.arange(4.0), x)),
    ],
)
def test_jumps_are_stored(act):
    def f(a, b):
        return a + act(b), b

    exposed = _n_stored(f, _X, _X)
    assert exposed.n >= 1
    assert len(exposed.kept) == exposed.n
    assert all(k.reason in ("decision", "inputs") for k in exposed.kept)
    assert all("test_continuity.py" in k.where for k in exposed.kept), exposed.kept


def test_kinks_are_stored_only_with_kinks_store():
    def f(a, b):
        return a + jnp.max(b, -1, keepdims=True) + jax.nn.leaky_relu(b), b

    assert _n_stored(f, _X, _X).n == 0
    exposed = _n_stored(f, _X, _X, kinks="store")
    # The maximum stores a copy of b; leaky_relu's comparison of b is then
    # made again from that copy, exactly, and not stored.
    assert exposed.n == 1
    assert {k.primitive for k in exposed.kept} == {"reduce_max"}

    def g(a, b):
        return a + jax.nn.leaky_relu(b), b

    assert _n_stored(g, _X, _X).n == 0
    exposed = _n_stored(g, _X, _X, kinks="store")
    assert [k.primitive for k in exposed.kept] == ["ge"]


def test_a_kink_under_stop_gradient_is_not_stored():
    def f(a, b):
        return a + jax.nn.softmax(b), b

    assert _n_stored(f, _X, _X, kinks="store").n == 0


def test_nested_decisions_are_stored_with_where_they_sit():
    def step(h):
        return jnp.where(h > 0, h + 1.0, h)

    def f(a, b):
        c = jax.checkpoint(step)(b)
        s = lax.scan(lambda acc, t: (acc + step(b - t), None), b, jnp.ones(5))[0]
        k = lax.cond(b[0, 0] > 100.0, lambda h: h, step, b)
        return a + c + s + k, b

    exposed = _n_stored(f, _X, _X)
    within = sorted(k.within for k in exposed.kept if k.within)
    assert within == [("checkpoint",), ("cond",), ("scan",)]
    (scan_kept,) = [
        v
        for v, k in zip(exposed.jaxpr.outvars[-exposed.n :], exposed.kept)
        if k.within == ("scan",)
    ]
    assert scan_kept.aval.shape == (5, *_X.shape)  # one per step


def test_a_decision_in_a_while_loop_is_refused_in_one_line():
    def f(a, b):
        def body(c):
            return jnp.where(c[0] > 0, c[0] + 1.0, c[0]) * 0.5, c[1] + 1

        return a + lax.while_loop(lambda c: c[1] < 3, body, (b, 0))[0], b

    with pytest.raises(ValueError, match="while_loop body") as info:
        jax.grad(lambda a, b: jnp.sum(revnet.invertible(f)(a, b)[0]))(_X, _X)
    msg = str(info.value)
    assert "\n" not in msg and "fori_loop" in msg and "test_continuity.py" in msg
    # An integer result of a while loop on rebuilt values is stored whole.

    def count(a, b):
        n = lax.while_loop(
            lambda c: c[0] < 4.0, lambda c: (c[0] * 2, c[1] + 1), (b[0, 0], 0)
        )
        return a + n[1], b

    exposed = _n_stored(count, _X, _X)
    assert [k.primitive for k in exposed.kept] == ["while"]


def test_a_data_dependent_stop_points_to_revnet_while_loop():
    """A lax.while_loop whose stop reads rebuilt values cannot be written as
    fori_loop or scan: the refusal names revnet.while_loop too."""

    def f(a, b):
        stop = lambda c: jnp.sum(c[0]) < 50.0  # noqa: E731
        x, _ = lax.while_loop(stop, lambda c: (c[0] * 2.0, c[1] + 1), (b, 0))
        return a + x, b

    with pytest.raises(ValueError, match="while_loop condition") as info:
        jax.grad(lambda a, b: jnp.sum(revnet.invertible(f)(a, b)[0]))(_X, _X + 3.0)
    msg = str(info.value)
    assert "\n" not in msg and "`lt` at" in msg and "test_continuity.py" in msg
    assert "fori_loop" in msg and "revnet.while_loop" in msg, msg


def test_kinks_are_stored_when_decisions_are_recomputed():
    """kinks='store' stores kinks whatever decisions= is; decisions='recompute'
    drops only the decisions."""

    def f(a, b):
        return a + jax.nn.relu(b) + jnp.where(b > 0.5, 1.0, 0.0), b

    kinds = lambda **kw: [k.reason for k in _n_stored(f, _X, _X, **kw).kept]  # noqa: E731
    assert kinds(kinks="store", decisions="recompute") == ["kink"]
    assert kinds(kinks="store") == ["kink", "decision"]
    assert kinds() == ["decision"]
    assert kinds(decisions="recompute") == []
    # A kink inside a lax.while_loop is refused as a kink, with its option.

    def g(a, b):
        body = lambda c: (c[0] + jax.nn.relu(c[0]) * 0.5, c[1] + 1)  # noqa: E731
        return a + lax.while_loop(lambda c: c[1] < 3, body, (b, 0))[0], b

    with pytest.raises(ValueError, match="while_loop body") as info:
        _n_stored(g, _X, _X, kinks="store", decisions="recompute")
    msg = str(info.value)
    assert msg.startswith("a kink (") and "kinks='recompute'" in msg, msg
    assert "decisions=" not in msg, msg


def test_a_user_marks_a_select_either_way():
    """revnet.kink recomputes a predicate revnet cannot prove continuous;
    revnet.decision stores one it would recompute."""
    t = jnp.asarray(0.5)

    def maximum(a, b):  # max(b, t) with a threshold revnet cannot see
        return a + jnp.where(b > t, b, t), b

    def marked_max(a, b):
        return a + jnp.where(revnet.kink(b > t), b, t), b

    def leaky(a, b):
        return a + jnp.where(revnet.decision(b >= 0), b, 0.01 * b), b

    assert _n_stored(maximum, _X, _X).n == 1
    assert _n_stored(marked_max, _X, _X).n == 0
    assert _n_stored(marked_max, _X, _X, kinks="store").n == 1
    assert _n_stored(leaky, _X, _X).n == 1
    for f in (marked_max, leaky):
        want = jax.grad(lambda a, b: jnp.sum(jnp.sin(f(a, b)[0])), (0, 1))(_X, _X)
        got = jax.grad(
            lambda a, b: jnp.sum(jnp.sin(revnet.invertible(f)(a, b)[0])), (0, 1)
        )(_X, _X)
        tol = tolerance("float32", "values")  # one addition
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=tol, atol=tol)
