"""Coverage of the inverse rules: every registered rule and every structural rule.

Two tables drive the tests:

* ``_RULE_CASES`` maps each registered primitive name to a small program
  ``f(x, w) -> y`` whose *inverted* path contains that primitive (the equation
  has an input that depends on ``x``), with an input domain where it is
  invertible. ``test_every_registered_rule_has_a_case`` fails when a rule is
  registered without a case here.
* ``_STRUCTURAL`` holds programs built from the constructs the analysis handles
  structurally (``select_n``, covering slices + ``concatenate``, nested
  ``jit``, ``jax.checkpoint``, ``custom_jvp``, ``custom_vjp``, ``lax.scan``,
  ``revnet.scan``). Each runs on its own and, when its output is an array
  shaped like its input, inside ``jnp.where(mask, program(x), 2 * x)`` and
  inside a ``lax.scan`` body.
* A rule or construct may have further cases (``_RULE_CASES`` names them
  ``rule:variant``): other operands unknown, literals, other parameters.
* Every elementwise rule's case also runs inside ``jnp.where``, so that the
  analysis's notion of "elementwise" cannot drift from the registry.

Every case checks, in float32 and float64, that the construct really occurs on
the inverted path of ``jax.make_jaxpr`` (so a case fails when it stops
exercising its rule), that ``revnet.inverse`` gives ``x`` back, and that the
gradients of ``revnet.invertible(f)`` with respect to the input and the weights
equal plain ``jax.grad``'s, elementwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import primitives
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import revnet
from revnet._engine import jaxpr as jx
from revnet._engine import registry
from tests.helpers import (
    assert_trees_close,
    cotangents_like,
    slogdet_reference,
    tolerance,
)


def _registered_rule_names() -> set[str]:
    """Names of every registered primitive (non-structural) inverse rule."""
    return {n for n in registry.names() if not registry.get(n).structural}


SHAPE = (4, 6)
_PERM = np.array([3, 0, 5, 1, 4, 2], np.int32)  # of SHAPE's last axis
_ROWS = np.array([2, 3, 1, 0], np.int32)  # of its first
_MASK = np.arange(24).reshape(SHAPE) % 3 == 0


def _domain(kind: str, key: jax.Array, shape, dtype) -> jax.Array:
    z = jax.random.normal(key, shape, dtype)
    if kind == "real":
        return 0.7 * z
    if kind == "positive":
        return jnp.exp(0.5 * z)
    if kind == "unit":  # well inside (-1, 1)
        return 0.8 * jnp.tanh(z)
    if kind == "nonzero":  # |x| >= 0.5
        return jnp.sign(z) * (0.5 + jnp.abs(z))
    raise ValueError(f"unknown domain {kind!r}")


def _s(w):
    """A known factor in [0.9, 1.1] made of a weight: gives ``w`` a gradient."""
    return 1.0 + 0.1 * jnp.tanh(w)


@dataclasses.dataclass(frozen=True)
class _Case:
    """A program ``fn(x, w) -> y`` invertible in ``x`` on ``domain``.

    ``needs`` lists the primitives that must occur on the path from ``x``;
    ``w_shape`` is the weight's shape; ``dtypes`` the input dtypes it runs in.
    """

    fn: Callable
    needs: tuple[str, ...]
    domain: str = "real"
    w_shape: tuple[int, ...] = SHAPE
    dtypes: tuple[str, ...] = ("float32", "float64")
    mesh: Callable[[], object] | None = None  # a mesh to set around the run
    slow: tuple[str, ...] = ()  # the dtypes it runs in only in the slow tier


def _unary(prim: str, fn: Callable, domain: str = "real", **kw) -> _Case:
    return _Case(lambda x, w: fn(x * _s(w)), (prim,), domain, **kw)


def _rule_name(case_name: str) -> str:
    """The rule a case of ``_RULE_CASES`` is for: its name up to a ``:``."""
    return case_name.split(":")[0]


# Further cases of a rule (named ``rule:variant``) run in the slow tier, in
# float32 too when they are not already in the fast tier.
_SLOW = ("float32", "float64")
_SLOW_F64 = ("float64",)


# Sharding rules on this process's one device: a one-device mesh (the rules on
# 8 devices, with real exchanges, are tested in ``tests/sharding/test_sharding.py``).
def _mesh1() -> Mesh:
    return Mesh(np.array(jax.devices()[:1]), ("i",))


def _explicit_mesh1():
    return jax.make_mesh((1,), ("i",), axis_types=(AxisType.Explicit,))


_SPLIT = P("i")


def _per_device(fn: Callable, x_spec=_SPLIT) -> Callable:
    """``fn(x, w)`` as the body of a ``shard_map`` over a one-device mesh."""
    return lambda x, w: jax.shard_map(
        fn, mesh=_mesh1(), in_specs=(x_spec, P()), out_specs=P("i")
    )(x, w)


_RULE_CASES: dict[str, _Case] = {
    # Arithmetic (a further case solves the other operand, or has a literal).
    "add": _Case(lambda x, w: x + w, ("add",)),
    "add_any": _Case(lambda x, w: primitives.add_jaxvals_p.bind(x, w), ("add_any",)),
    "add:known_left": _Case(lambda x, w: w + (2.0 - x), ("add", "sub"), slow=_SLOW),
    "sub": _Case(lambda x, w: w - x, ("sub",)),
    "sub:unknown_left": _Case(
        lambda x, w: -(x * _s(w) + 1.5) - 0.5,
        ("mul", "add", "neg", "sub"),
        slow=_SLOW_F64,
    ),
    "neg": _Case(lambda x, w: -(x * _s(w)), ("neg",)),
    "mul": _Case(lambda x, w: x * (1.5 + jnp.tanh(w)), ("mul",)),
    "div": _Case(lambda x, w: (1.5 + jnp.tanh(w)) / x, ("div",), "nonzero"),
    "div:literal_numerator": _Case(
        lambda x, w: 2.0 / (jnp.exp(x * _s(w)) + 1.0), ("exp", "div"), slow=_SLOW
    ),
    "div:unknown_numerator": _Case(
        lambda x, w: (x * _s(w) * 3.0) / 4.0, ("mul", "div"), slow=_SLOW_F64
    ),
    # Elementwise bijections.
    "exp": _unary("exp", jnp.exp),
    "exp2": _unary("exp2", jnp.exp2),
    "log2": _unary("log2", jnp.log2, "positive"),
    "log": _unary("log", jnp.log, "positive"),
    "log1p": _unary("log1p", jnp.log1p, "positive"),
    "expm1": _unary("expm1", jnp.expm1),
    "tanh": _unary("tanh", jnp.tanh),
    "atanh": _unary("atanh", jnp.arctanh, "unit"),
    "logistic": _unary("logistic", jax.nn.sigmoid),
    "sinh": _unary("sinh", jnp.sinh),
    "asinh": _unary("asinh", jnp.arcsinh),
    "sqrt": _unary("sqrt", jnp.sqrt, "positive"),
    "rsqrt": _unary("rsqrt", lax.rsqrt, "positive"),
    "cbrt": _unary("cbrt", jnp.cbrt, "nonzero"),
    "erf_inv": _unary("erf_inv", jax.scipy.special.erfinv, "unit"),
    "copy": _unary("copy", lambda v: jnp.array(v, copy=True)),
    "integer_pow": _unary("integer_pow", lambda v: v**3, "nonzero"),
    "integer_pow:negative_odd": _unary(
        "integer_pow", lambda v: (jnp.exp(v) + 1.0) ** -3, slow=_SLOW
    ),
    "cumsum": _unary("cumsum", lambda v: jnp.cumsum(v, axis=0)),
    "cumsum:reverse": _unary(
        "cumsum", lambda v: lax.cumsum(v, axis=1, reverse=True), slow=_SLOW
    ),
    # A widening conversion; float64 has no wider float type to widen to.
    "convert_element_type": _Case(
        lambda x, w: (x * _s(w)).astype(jnp.float64),
        ("convert_element_type",),
        dtypes=("float32",),
    ),
    # Shape and layout.
    "reshape": _unary("reshape", lambda v: v.reshape(3, 8)),
    "squeeze": _unary("squeeze", lambda v: jnp.squeeze(v[None], 0)),
    "squeeze:two_axes": _Case(
        lambda x, w: jnp.squeeze(x[None, :, None, :], (0, 2)) * _s(w),
        ("broadcast_in_dim", "squeeze"),
        slow=_SLOW,
    ),
    "broadcast_in_dim": _unary(
        "broadcast_in_dim", lambda v: lax.broadcast_in_dim(v, (1, *SHAPE), (1, 2))
    ),
    "transpose": _unary("transpose", lambda v: v.T),
    # A permutation that is not its own inverse.
    "transpose:3d": _Case(
        lambda x, w: jnp.transpose((x * _s(w)).reshape(3, 2, 4), (2, 0, 1)),
        ("reshape", "transpose"),
        slow=_SLOW,
    ),
    "rev": _unary("rev", lambda v: jnp.flip(v, 0)),
    # A permutation of the features (x[..., perm]) and, further, of the rows by
    # a jnp.take whose indices arrive in another order than sorted.
    "gather": _unary("gather", lambda v: v[..., _PERM]),
    "gather:rows": _unary(
        "gather", lambda v: jnp.take(v, jnp.asarray(_ROWS), axis=0), slow=_SLOW
    ),
    # The inverse permutation written back: z.at[..., perm].set(x) and .add(x).
    "scatter": _unary("scatter", lambda v: jnp.zeros_like(v).at[:, _PERM].set(v)),
    "scatter-add": _unary("scatter-add", lambda v: jnp.ones_like(v).at[_ROWS].add(v)),
    # A known update added into the unknown operand, at any indices.
    "scatter-add:operand": _Case(
        lambda x, w: (x * _s(w)).at[:, np.array([0, 0, 2], np.int32)].add(w[:, :3]),
        ("scatter-add",),
    ),
    "concatenate": _Case(
        lambda x, w: jnp.concatenate([x * _s(w), jnp.tanh(w)], axis=0),
        ("concatenate",),
    ),
    # Two unknown pieces, one of them empty.
    "concatenate:empty_piece": _Case(
        lambda x, w: jnp.concatenate([x * _s(w) * 2.0, x[:0]], axis=0),
        ("slice", "concatenate"),
        slow=_SLOW,
    ),
    "split": _unary("split", lambda v: tuple(jnp.split(v, [1, 3], axis=0))),
    "select_n": _Case(
        lambda x, w: jnp.where(w > 0, x * 2.0, jnp.exp(x)), ("select_n",)
    ),
    # One case is the input itself.
    "select_n:conditional_update": _Case(
        lambda x, w: jnp.where(_MASK, x, x - 3.0 * _s(w)), ("select_n",), slow=_SLOW
    ),
    # Sharding: identity-like primitives and collectives.
    "sharding_constraint": _Case(
        lambda x, w: lax.with_sharding_constraint(
            x * _s(w), NamedSharding(_mesh1(), P())
        ),
        ("sharding_constraint",),
    ),
    "reshard": _Case(
        lambda x, w: jax.sharding.reshard(x * _s(w), P()),
        ("reshard",),
        mesh=_explicit_mesh1,
    ),
    "pvary": _Case(
        _per_device(lambda x, w: lax.pcast(x * _s(w), "i", to="varying"), P()),
        ("pvary",),
    ),
    "ppermute": _Case(
        _per_device(lambda x, w: lax.ppermute(x * _s(w), "i", [(0, 0)])),
        ("ppermute",),
    ),
    "all_gather": _Case(
        _per_device(lambda x, w: lax.all_gather(x * _s(w), "i", tiled=True)),
        ("all_gather",),
    ),
    "all_to_all": _Case(
        _per_device(lambda x, w: lax.all_to_all(x * _s(w), "i", 0, 1, tiled=True)),
        ("all_to_all",),
    ),
    # Linear algebra: a known, well-conditioned square matrix.
    "dot_general": _Case(
        lambda x, w: x @ (jnp.eye(6, dtype=w.dtype) + 0.1 * w),
        ("dot_general",),
        w_shape=(6, 6),
    ),
    "dot_general:unknown_right": _Case(
        lambda x, w: (jnp.eye(4, dtype=w.dtype) + 0.1 * w) @ x,
        ("dot_general",),
        w_shape=(4, 4),
        slow=_SLOW_F64,
    ),
}


# --------------------------------------------------------------------------- #
# Which primitives lie on the path from the input.


def _sub_jaxprs(eqn):
    """Nested jaxprs whose inputs correspond one to one to the equation's (a
    hijax call's expansion, such as revnet's own calls, included)."""
    if eqn.primitive.name == jx.HI_CALL:
        body = jx.call_body(eqn)
        if body is not None and not body.consts:
            yield body.jaxpr
    for value in eqn.params.values():
        inner = getattr(value, "jaxpr", value)
        if hasattr(inner, "eqns") and len(inner.invars) == len(eqn.invars):
            yield inner


def _walk(jaxpr, dependent: list[bool], seen: set[str]) -> list[bool]:
    """Adds to ``seen`` the primitives with an input depending on the marked
    inputs of ``jaxpr``; returns which of its outputs depend on them."""
    dep = {v for v, d in zip(jaxpr.invars, dependent, strict=True) if d}
    for eqn in jaxpr.eqns:
        ins = [not hasattr(v, "val") and v in dep for v in eqn.invars]
        if not any(ins):
            continue
        seen.add(eqn.primitive.name)
        outs = [True] * len(eqn.outvars)
        for inner in _sub_jaxprs(eqn):
            ins_now = list(ins)
            carry = eqn.params.get("num_carry", 0)
            start = eqn.params.get("num_consts", 0)
            for _ in range(2 if carry else 1):  # a scan's carry feeds back
                inner_outs = _walk(inner, ins_now, seen)
                for i in range(carry):
                    ins_now[start + i] |= inner_outs[i]
            outs = inner_outs
        dep.update(v for v, d in zip(eqn.outvars, outs, strict=True) if d)
    return [not hasattr(v, "val") and v in dep for v in jaxpr.outvars]


def _primitives_on_path(fn, x, w) -> set[str]:
    closed = jax.make_jaxpr(fn)(x, w)
    seen: set[str] = set()
    _walk(closed.jaxpr, [True, False], seen)
    return seen


# --------------------------------------------------------------------------- #
# The check every case runs.


def _check(fn: Callable, needs, domain: str, w_shape, dtype: str, mesh=None) -> None:
    x64 = dtype == "float64" or "convert_element_type" in needs
    with (
        jax.enable_x64(x64),
        jax.set_mesh(mesh()) if mesh else contextlib.nullcontext(),
    ):
        dt = jnp.dtype(dtype)
        kx, kw = jax.random.split(jax.random.key(7))
        x = _domain(domain, kx, SHAPE, dt)
        w = 0.5 * jax.random.normal(kw, w_shape, dt)
        missing = set(needs) - _primitives_on_path(fn, x, w)
        assert not missing, f"{sorted(missing)} not on the path from x"
        cts = cotangents_like(jax.eval_shape(fn, x, w), seed=3)

        def loss(x, w, rev):
            f = lambda x: fn(x, w)  # noqa: E731
            ys = revnet.invertible(f)(x) if rev else f(x)
            return sum(
                jnp.sum(y * c)
                for y, c in zip(jax.tree.leaves(ys), jax.tree.leaves(cts), strict=True)
            ), ys

        @jax.jit
        def run(x, w):
            want, got = (
                jax.grad(loss, (0, 1), has_aux=True)(x, w, rev) for rev in (False, True)
            )
            back = revnet.inverse(lambda x: fn(x, w), x)(want[1])
            return want, got, back

        (want, ys), (got, rev_ys), back = run(x, w)
        rtol = tolerance(dt)
        assert_trees_close(rev_ys, ys, rtol, "output")
        assert_trees_close(back, (x,), rtol, "inverse")
        assert_trees_close(got, want, rtol, "gradients (x, w)")


DTYPES = ("float32", "float64")


# Rules of primitives that only later supported JAX releases have, with the
# first such release: jnp.log2 is log(x) / log(2) in jax 0.10.
_LATER_PRIMITIVES = {"log2": (0, 11)}
_JAX = tuple(int(p) for p in jax.__version__.split(".")[:2])


def _rule_params():
    for name in sorted(_RULE_CASES):
        case = _RULE_CASES[name]
        since = _LATER_PRIMITIVES.get(_rule_name(name))
        for dtype in case.dtypes:
            marks = [pytest.mark.slow] if dtype in case.slow else []
            if since is not None and _JAX < since:
                why = f"jax {jax.__version__} has no {name} primitive (from {since})"
                marks.append(pytest.mark.skip(reason=why))
            yield pytest.param(name, dtype, marks=marks)


@pytest.mark.parametrize("name,dtype", _rule_params())
def test_registered_rule(name, dtype):
    case = _RULE_CASES[name]
    _check(case.fn, case.needs, case.domain, case.w_shape, dtype, case.mesh)


def _log_det_params():
    """The float64 cases whose rule has a log-determinant term and whose
    program maps ``x`` to one array of its size (a square map)."""
    for name in sorted(_RULE_CASES):
        case = _RULE_CASES[name]
        rule = registry.get(_rule_name(name))
        if "float64" not in case.dtypes or case.mesh is not None:
            continue
        if rule is None or rule.structural or rule.log_det is None:
            continue
        since = _LATER_PRIMITIVES.get(_rule_name(name))
        if since is not None and _JAX < since:
            continue
        with jax.enable_x64(True):
            x = jnp.zeros(SHAPE, jnp.float64)
            w = jnp.zeros(case.w_shape, jnp.float64)
            out = jax.eval_shape(case.fn, x, w)
        if getattr(out, "size", None) != x.size or not jnp.issubdtype(
            out.dtype, jnp.floating
        ):
            continue
        marks = [pytest.mark.slow] if "float64" in case.slow else []
        yield pytest.param(name, marks=marks)


@pytest.mark.parametrize("name", _log_det_params())
def test_registered_rule_log_det(name):
    """Each case of a rule with a log-determinant term: the derived
    log-determinant is ``slogdet(jacfwd)``'s, in float64 (a declared term
    that is wrong, or zero where it is not, fails here)."""
    case = _RULE_CASES[name]
    with jax.enable_x64(True):
        kx, kw = jax.random.split(jax.random.key(7))
        x = _domain(case.domain, kx, SHAPE, jnp.dtype("float64"))
        w = 0.5 * jax.random.normal(kw, case.w_shape, jnp.float64)
        _, got = revnet.forward_and_log_det(case.fn, x, w, known_argnums=1)
        want = slogdet_reference(lambda w, x: case.fn(x, w), (w,), x)
        np.testing.assert_allclose(got, want, rtol=tolerance("float64", "log_det"))


def _live_primitive_names() -> set[str]:
    names = {
        getattr(p, "name", None)
        for p in vars(primitives).values()
        if hasattr(p, "bind")
    }
    assert names, "no primitives found: the check would be vacuous"
    return names


def test_every_registered_rule_has_a_case():
    # Structural rules are also registered under the names older JAX versions
    # give the same primitive (``pjit``, ``custom_vjp_call_jaxpr``, ``remat``);
    # those that name no primitive of this JAX cannot appear in a program.
    live = _live_primitive_names()
    structural = {n for n in registry.names() if registry.get(n).structural}
    rules = {_rule_name(n) for n in _RULE_CASES}
    covered = rules | {n for _, needs in _STRUCTURAL.values() for n in needs}
    wanted = _registered_rule_names() | (structural & live)
    assert not wanted - covered, f"rules without a case: {sorted(wanted - covered)}"
    stale = rules - set(registry.names())
    assert not stale, f"cases without a rule: {sorted(stale)}"
    unchecked = [n for n, c in _RULE_CASES.items() if _rule_name(n) not in c.needs]
    assert not unchecked, f"cases that do not check their rule occurs: {unchecked}"


def _made_primitive_names() -> set[str]:
    """Names of every primitive JAX has made, public or not (``split``,
    ``pvary`` and ``reshard`` are not in ``jax.extend.core.primitives``)."""
    return {
        o.name
        for o in gc.get_objects()
        if isinstance(o, jax.extend.core.Primitive) and isinstance(o.name, str)
    }


def test_every_rule_names_a_primitive():
    # A rule under a name no primitive of this JAX has is dead: no program can
    # contain it (``copy_p.name`` is "copy"; ``expand_dims`` is a
    # ``broadcast_in_dim``).
    later = {n for n, since in _LATER_PRIMITIVES.items() if _JAX < since}
    dead = _registered_rule_names() - _made_primitive_names() - later
    assert not dead, f"rules naming no primitive: {sorted(dead)}"


# --------------------------------------------------------------------------- #
# Structural rules, alone, inside jnp.where and inside a lax.scan body.


@jax.custom_jvp
def _straight_through_tanh(x):
    return jnp.tanh(x)


# The straight-through estimator: the derivative of the identity.
_straight_through_tanh.defjvp(lambda p, t: (_straight_through_tanh(p[0]), t[0]))


@jax.custom_vjp
def _sinh_half_grad(x):
    return jnp.sinh(x)


# A cotangent rule that differs from the true derivative, so that a gradient
# equal to plain autodiff's shows that the custom rule is the one applied.
_sinh_half_grad.defvjp(
    lambda x: (jnp.sinh(x), x), lambda x, g: (0.5 * g * jnp.cosh(x),)
)


# jax.extend's call of a closed jaxpr: the primitive ``closed_call`` in jax
# 0.10, ``eval_jaxpr`` from jax 0.11 on (``closed_call_p`` names it there).
_CLOSED_CALL = primitives.closed_call_p.name


def _closed_call(x, w):
    """``closed_call_p`` bound through ``jax.extend``, the public way to make
    one: no ``jax`` API stages it from user code."""
    body = jax.make_jaxpr(lambda x, w: x * _s(w) + w)(x, w)
    params = primitives.closed_call_p.get_bind_params({"call_jaxpr": body})
    return primitives.closed_call_p.bind(x, w, **params)[0]


def _step(c, v):
    return c * _s(v) + 0.1 * v, None


def _two_steps(w):
    return jnp.stack([w, -0.5 * w])


_STRUCTURAL: dict[str, tuple[Callable, tuple[str, ...]]] = {
    "select_n": (
        lambda x, w: jnp.where(w > 0, x * _s(w), jnp.exp(x)),
        ("select_n",),
    ),
    "slices_concatenate": (
        lambda x, w: jnp.concatenate([x[..., :2] * _s(w[..., :2]), x[..., 2:]], -1),
        ("slice", "concatenate"),
    ),
    "split_concatenate": (
        lambda x, w: jnp.concatenate(
            [a * 2.0 + b for a, b in zip(jnp.split(x, 2, -1), jnp.split(w, 2, -1))],
            -1,
        ),
        ("split", "concatenate"),
    ),
    "jit": (jax.jit(lambda x, w: x * _s(w) + w), ("jit",)),
    "closed_call": (_closed_call, (_CLOSED_CALL,)),
    "checkpoint": (
        jax.checkpoint(lambda x, w: jnp.exp(x * _s(w)) - 1.0),
        ("remat2",),
    ),
    "custom_jvp": (
        lambda x, w: _straight_through_tanh(x * _s(w)),
        ("custom_jvp_call",),
    ),
    "custom_vjp": (
        lambda x, w: _sinh_half_grad(x * _s(w)),
        ("custom_vjp_call",),
    ),
    "lax_scan": (
        lambda x, w: lax.scan(_step, x, _two_steps(w))[0],
        ("scan",),
    ),
    "revnet_scan": (
        lambda x, w: revnet.scan(_step, x, _two_steps(w))[0],
        ("custom_vjp_call", "scan"),
    ),
    "shard_map": (
        _per_device(lambda x, w: x * _s(w) + w),
        ("shard_map",),
    ),
    # Slices as outputs: halves, and tiles cut along both axes.
    "slices_halves": (
        lambda x, w: (x[..., :2], jnp.exp(x[..., 2:] * _s(w[..., 2:]))),
        ("slice",),
    ),
    "slices_tile": (
        lambda x, w: (x[:2] * _s(w[:2]), x[2:, :1], x[2:, 1:] + 1.0),
        ("slice",),
    ),
    # A reversed scan with outputs besides its carry.
    "lax_scan_reverse_with_ys": (
        lambda x, w: lax.scan(
            lambda c, v: (c * 0.5 - v, jnp.sum(c)), x, _two_steps(w), reverse=True
        ),
        ("scan",),
    ),
    # The input as the scanned-over values, with a carry that does not depend
    # on it.
    "lax_scan_unknown_xs": (
        lambda x, w: lax.scan(
            lambda c, xw: (c, jnp.exp(xw[0] * _s(xw[1]))),
            jnp.zeros((), x.dtype),
            (x, w),
        )[1],
        ("scan",),
    ),
}
# The contexts of the programs that are not an array shaped like the input.
_STRUCTURAL_CONTEXTS = {
    "slices_halves": ("alone",),
    "slices_tile": ("alone",),
    "lax_scan_reverse_with_ys": ("alone",),
}
# Further cases of a construct run in the slow tier, in float32 too when they
# are not already in the fast tier.
_STRUCTURAL_SLOW = {
    "slices_halves": ("float64",),
    "slices_tile": DTYPES,
    "lax_scan_reverse_with_ys": DTYPES,
    "lax_scan_unknown_xs": DTYPES,
}


def _in_where(fn):
    return lambda x, w: jnp.where(_MASK, fn(x, w), 2.0 * x)


def _in_scan(fn):
    return lambda x, w: lax.scan(lambda c, v: (fn(c, v), None), x, _two_steps(w))[0]


_CONTEXTS = {"alone": lambda fn: fn, "in_where": _in_where, "in_scan": _in_scan}
_CONTEXT_NEEDS = {"alone": (), "in_where": ("select_n",), "in_scan": ("scan",)}

# Slices put back in place: a ``select_n`` case is followed back only through
# equations that keep every position where it is (elementwise ones, calls and
# scans whose bodies are such, nested selects); a ``concatenate`` of pieces
# cut from one value by ``slice``/``split`` is not followed.
_SELECT_DEFECT = pytest.mark.xfail(
    strict=True,
    raises=revnet.NotInvertibleError,
    reason="known limitation: select_n does not follow a case through slices "
    "of one value concatenated back in place",
)
_KNOWN_DEFECTS = {
    ("slices_concatenate", "in_where"): _SELECT_DEFECT,
    ("split_concatenate", "in_where"): _SELECT_DEFECT,
    ("shard_map", "in_where"): pytest.mark.xfail(
        strict=True,
        raises=revnet.NotInvertibleError,
        reason="known limitation: select_n does not follow a case into a "
        "shard_map's per-device body",
    ),
    ("lax_scan_unknown_xs", "in_where"): pytest.mark.xfail(
        strict=True,
        raises=revnet.NotInvertibleError,
        reason="known limitation: select_n does not follow a case through a "
        "scan over it as the scanned-over values",
    ),
}


def _structural_params():
    for name in sorted(_STRUCTURAL):
        for context in _STRUCTURAL_CONTEXTS.get(name, tuple(_CONTEXTS)):
            for dtype in DTYPES:
                mark = _KNOWN_DEFECTS.get((name, context))
                marks = [mark] if mark else []
                if dtype in _STRUCTURAL_SLOW.get(name, ()):
                    marks.append(pytest.mark.slow)
                yield pytest.param(name, context, dtype, marks=marks)


@pytest.mark.parametrize("name,context,dtype", _structural_params())
def test_structural_rule(name, context, dtype):
    fn, needs = _STRUCTURAL[name]
    program = _CONTEXTS[context](fn)
    _check(program, needs + _CONTEXT_NEEDS[context], "real", SHAPE, dtype)


# The rules of elementwise bijections (and arithmetic with a known operand).
_ELEMENTWISE = (
    "add",
    "add_any",
    "sub",
    "neg",
    "mul",
    "div",
    "exp",
    "exp2",
    "log2",
    "log",
    "log1p",
    "expm1",
    "tanh",
    "atanh",
    "logistic",
    "sinh",
    "asinh",
    "sqrt",
    "rsqrt",
    "cbrt",
    "erf_inv",
    "copy",
    "integer_pow",
    "convert_element_type",
)


def test_elementwise_cases_cover_the_registry():
    elementwise = {n for n in registry.names() if registry.get(n).elementwise}
    assert set(_ELEMENTWISE) == elementwise


def _elementwise_params():
    for name in _ELEMENTWISE:
        since = _LATER_PRIMITIVES.get(name)
        if since is not None and _JAX < since:
            why = f"jax {jax.__version__} has no {name} primitive (from {since})"
            yield pytest.param(name, marks=pytest.mark.skip(reason=why))
        else:
            yield name


@pytest.mark.parametrize("name", _elementwise_params())
def test_elementwise_rule_inside_where(name):
    # One dtype: the rules run in both dtypes above.
    case = _RULE_CASES[name]
    _check(
        _in_where(case.fn),
        (*case.needs, "select_n"),
        case.domain,
        case.w_shape,
        case.dtypes[-1],
    )


def test_where_refuses_a_call_that_moves_positions():
    # Invertible, but the call's output at a position comes from another
    # position of its input: the case cannot be solved where it is selected.
    def f(x):
        moved = jax.checkpoint(lambda v: jnp.flip(v, 0) * 2.0)(x)
        return jnp.where(_MASK, moved, 2.0 * x)

    with pytest.raises(revnet.NotInvertibleError, match="common value"):
        revnet.invertible(f)(jnp.ones(SHAPE))
