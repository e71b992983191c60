"""Continuity: what an equation's result does when a rebuilt input moves.

The backward pass evaluates equations again on *rebuilt* values, which differ
from the forward values by rounding. Whether that matters is a property of
the primitive and its operands, and this module is the one place that says
it. Every equation reading a rebuilt floating-point value falls in one class:

=========== ===============================================================
class       what a rounding-sized move of a rebuilt float input does
=========== ===============================================================
smooth      moves the result by as little (and its derivative too, almost
            everywhere): recomputed
kink        moves the result by as little, but the derivative can jump at a
            tie (``max``, ``abs``, ``clamp``, max-pooling): recomputed, or
            stored with ``kinks="store"``
decision    can move the result by a jump (a comparison, ``round``, ``rem``,
            a narrowing cast, an index): stored
guard       a NaN/Inf test (``x != x``, ``is_finite``, ``x == inf``): a
            non-finite value is the run-time checks' business, not a branch
            to store
structural  a call, loop or branch: its body is classified, equation by
            equation (:mod:`revnet._engine.decisions`)
=========== ===============================================================

A cast to a narrower float is rounding: into a computation done in the
narrow dtype (a ``compute_dtype`` policy) it is that computation's own
rounding, recomputed like it, also where the computation widens on the way
and rounds back (a LayerNorm accumulating in float32, then returning
bfloat16); cast back to a wider float that reaches an output as such (fake
quantisation, ``x.astype(bfloat16).astype(float32)``) it is a decision.

The rule is "a decision unless proven otherwise": a primitive not listed as
smooth, kink, guard or structural is a decision when it reads a rebuilt float,
unless JAX can transpose it (:func:`linear`: a linear map of its float
inputs, such as ``stack`` or a layout primitive a later JAX adds, is
smooth), and any equation whose results are all integers or booleans is a
decision. A
``select_n`` whose predicate compares a rebuilt value with a constant is a
kink when its cases agree at the switching point (``leaky_relu``, ``elu``,
``hard_tanh``): :func:`continuous_at_switch` decides that from the program by
evaluating the cases there, and where it cannot, the predicate stays a
decision.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from revnet._engine import jaxpr as jx
from revnet._engine import registry
from revnet._engine.cotangents import is_float_aval
from revnet._engine.registry import DECISION, GUARD, KINK, SMOOTH, STRUCTURAL

# The classes of the primitives without an inverse rule; a primitive with one
# is declared with it (revnet.rules, registry.define), in one place.
#
# Continuous in every float input, with a derivative continuous almost
# everywhere (where the primitive is defined): elementwise maps, linear maps,
# data movement, collectives and identities.
_SMOOTH_NAMES = """
abs_sq one_minus_square polynomial sin cos tan asin acos atan cosh acosh pow
square erf erfc lgamma digamma polygamma zeta igamma igammac igamma_grad_a
random_gamma_grad regularized_incomplete_beta bessel_i0e bessel_i1e conj real
imag complex ragged_dot_general conv_general_dilated reduce_sum reduce_prod
cumprod cumlogsumexp reduce_window_sum expand_dims pad slice dynamic_slice
dynamic_update_slice scatter_add scatter-mul scatter_mul select_n copy_p
stop_gradient device_put psum psum2 pmean ragged_all_to_all mesh_cast pcast
optimization_barrier name fft cholesky triangular_solve tridiagonal_solve
householder_product custom_lin mul_add reduce_and reduce_or reduce_xor
axis_index iota psum_invariant all_gather_invariant all_gather_reduced
reduce_scatter pbroadcast unreduced_psum unreduced_reduce_scatter preduced
reduced_vary_cast_p vary_unreduced_cast_p broadcast_to shard_alike
layout_constraint with_memory_space_constraint zeros_like
""".split()

# Continuous in value; the derivative jumps where the chosen operand changes.
_KINK_NAMES = """
max min abs clamp reduce_max reduce_min cummax cummin reduce_window_max
reduce_window_min scatter-max scatter_max scatter-min scatter_min pmax pmin
select_and_gather_add masked_cummax masked_cummin
""".split()

# Named for the coverage table: results that jump in a float input. Any
# unlisted primitive reading a rebuilt float is a decision too.
_DECISION_NAMES = """
sign round floor ceil rem nextafter reduce_precision argmax argmin sort top_k
approx_top_k eq ne lt le gt ge eq_to le_to lt_to not and or xor
bitcast_convert_type atan2 lu qr eigh eig svd schur hessenberg tridiagonal
select_and_scatter select_and_scatter_add reduce reduce_window random_gamma
population_count clz shift_left shift_right_arithmetic shift_right_logical
random_bits random_seed random_split random_fold_in random_wrap random_unwrap
threefry2x32 rng_bit_generator rng_uniform
""".split()

# Calls, loops and branches: their bodies are classified.
_STRUCTURAL_NAMES = """
jit pjit closed_call core_call call eval_jaxpr custom_jvp_call custom_vjp_call
custom_vjp_call_jaxpr remat remat2 checkpoint scan while cond shard_map
custom_linear_solve call_hi_primitive get swap empty2 after_all create_token
new_ref empty_ref free_ref freeze addupdate accum_grad_in_ref debug_callback
debug_print
""".split()

_COMPARISONS = frozenset({"eq", "ne", "lt", "le", "gt", "ge"})
registry.declare_continuity(["is_finite"], GUARD)
registry.declare_continuity(_DECISION_NAMES, DECISION)
registry.declare_continuity(_SMOOTH_NAMES, SMOOTH)
registry.declare_continuity(_KINK_NAMES, KINK)
registry.declare_continuity(_STRUCTURAL_NAMES, STRUCTURAL)


def table() -> Mapping[str, str]:
    """The class of every primitive revnet names (others are decisions):
    those declared here and those declared with their inverse rules."""
    return registry.continuity_table()


def primitive_class(name: str) -> str:
    """The class of the primitive ``name`` on a rebuilt float input, as the
    table says (an unlisted primitive is a decision; :func:`classify` also
    tries :func:`linear` on an unlisted equation)."""
    return registry.continuity(name) or DECISION


_LINEAR: dict = {}


def linear(eqn: Any) -> bool:
    """Whether ``eqn`` is a linear map of its inputs, all floats: JAX can
    transpose it (``jax.linear_transpose``). A linear map is continuous, with
    a constant derivative, so such an equation is smooth whatever its name.
    """
    avals = [jx.aval(v) for v in eqn.invars]
    outs = [jx.aval(v) for v in eqn.outvars]
    if not avals or not all(is_float_aval(a) for a in (*avals, *outs)):
        return False
    try:
        key = (jx.primitive_name(eqn), tuple(map(jx.aval_key, avals)), repr(eqn.params))
    except Exception:  # pragma: no cover - params that cannot be shown
        return False
    hit = _LINEAR.get(key)
    if hit is None:
        structs = [jx.struct(a) for a in avals]
        try:
            back = jax.linear_transpose(lambda *xs: jx.bind(eqn, *xs), *structs)
            jax.eval_shape(back, [jx.struct(a) for a in outs])
            hit = True
        except Exception:  # no transpose rule, or not linear
            hit = False
        if len(_LINEAR) > 4096:
            _LINEAR.clear()
        _LINEAR[key] = hit
    return hit


def _mantissa_and_range(dtype) -> tuple[int, int, int]:
    info = jnp.finfo(dtype)
    return int(info.nmant), int(info.maxexp), int(info.minexp)


def _narrowing(src, dst) -> bool:
    """Whether converting float ``src`` to float ``dst`` can round or overflow."""
    if not jnp.issubdtype(dst, jnp.floating):
        return True
    m1, hi1, lo1 = _mantissa_and_range(src)
    m2, hi2, lo2 = _mantissa_and_range(dst)
    return m2 < m1 or hi2 < hi1 or lo2 > lo1


def narrowing_float_cast(eqn: Any) -> bool:
    """Whether ``eqn`` casts a float to a narrower float (``float32`` to
    ``bfloat16``): a rounding to the narrow dtype's grid."""
    if jx.primitive_name(eqn) != "convert_element_type":
        return False
    src, dst = jx.aval(eqn.invars[0]).dtype, eqn.params["new_dtype"]
    floats = jnp.issubdtype(src, jnp.floating) and jnp.issubdtype(dst, jnp.floating)
    return bool(floats and _narrowing(src, dst))


def rounds_to(eqn: Any, dtype: Any, *, src: bool = False) -> bool:
    """Whether ``eqn`` casts a float to a float no wider than ``dtype`` (with
    ``src``: casts a float no wider than ``dtype`` to a float)."""
    if jx.primitive_name(eqn) != "convert_element_type":
        return False
    a, b = jx.aval(eqn.invars[0]).dtype, eqn.params["new_dtype"]
    floats = jnp.issubdtype(a, jnp.floating) and jnp.issubdtype(b, jnp.floating)
    return bool(floats and not _narrowing(a if src else b, dtype))


def widening_float_cast(eqn: Any) -> bool:
    """Whether ``eqn`` casts a float to a wider float (exactly)."""
    if jx.primitive_name(eqn) != "convert_element_type":
        return False
    src, dst = jx.aval(eqn.invars[0]).dtype, eqn.params["new_dtype"]
    floats = jnp.issubdtype(src, jnp.floating) and jnp.issubdtype(dst, jnp.floating)
    return bool(floats and src != dst and not _narrowing(src, dst))


def _infinite_literal(a) -> bool:
    if not jx.is_literal(a):
        return False
    v = np.asarray(jx.literal_value(a))
    return bool(v.dtype.kind == "f" and v.size and np.all(np.isinf(v)))


def is_comparison(eqn: Any) -> bool:
    """Whether ``eqn`` compares two values (``lt``, ``eq``, ...)."""
    return jx.primitive_name(eqn) in _COMPARISONS


def classify(eqn: Any) -> str:
    """The class of ``eqn`` when its float inputs are rebuilt.

    An equation whose results are all integers or booleans jumps, and so is
    a decision, unless it is a NaN/Inf guard.
    """
    name = jx.primitive_name(eqn)
    if name == "is_finite":
        return GUARD
    if name in _COMPARISONS:
        a, b = eqn.invars
        same = not jx.is_literal(a) and a is b
        if same or _infinite_literal(a) or _infinite_literal(b):
            return GUARD
        return DECISION
    cls = primitive_class(name)
    if cls == STRUCTURAL:
        return cls
    if name == "convert_element_type":
        src = jx.aval(eqn.invars[0]).dtype
        dst = eqn.params["new_dtype"]
        if jnp.issubdtype(src, jnp.floating) and not _narrowing(src, dst):
            return SMOOTH
        return DECISION
    if not any(is_float_aval(jx.aval(v)) for v in eqn.outvars):
        return DECISION
    if registry.continuity(name) is None and linear(eqn):
        return SMOOTH
    return cls


# -- a select whose cases agree where its predicate switches ----------------- #

# Equations through which a case is evaluated at the switching point: maps of
# one scalar per element (and broadcasts of scalars into them).
_POINTWISE = frozenset(
    """add sub mul div neg exp exp2 expm1 log log1p log2 logistic tanh
    one_minus_square polynomial sin cos tan
    asin acos atan sinh cosh asinh acosh atanh sqrt rsqrt cbrt pow integer_pow
    square erf erfc max min abs clamp select_n eq ne lt le gt ge not and or
    convert_element_type sign floor ceil round""".split()
)


def _scalar(a, point: Mapping[Any, Any], producer: Callable[[Any], Any], memo):
    """The value of atom ``a`` when the variables in ``point`` take their
    scalar values, or None when it depends on anything else."""
    if jx.is_literal(a):
        v = np.asarray(jx.literal_value(a))
        if v.size == 0 or not np.all(v == v.reshape(-1)[0]):
            return None
        return v.reshape(-1)[0]
    if a in point:
        return point[a]
    if a in memo:
        return memo[a]
    memo[a] = None  # cycles cannot occur; this marks "in progress"
    e = producer(a)
    if e is None:
        return None
    name = jx.primitive_name(e)
    if name == "broadcast_in_dim" or name == "reshape" and len(e.invars) == 1:
        val = _scalar(e.invars[0], point, producer, memo)
    elif name in _POINTWISE and len(e.outvars) == 1:
        ins = [_scalar(x, point, producer, memo) for x in e.invars]
        if any(x is None for x in ins):
            return None
        params = dict(jx.bind_params(e))
        if "sharding" in params:
            params["sharding"] = None
        try:
            with jax.ensure_compile_time_eval(), jx.context(e):
                out = e.primitive.bind(*[jnp.asarray(x) for x in ins], **params)
            val = np.asarray(out[0] if e.primitive.multiple_results else out)
        except Exception:  # a primitive that does not take scalars
            return None
    else:
        return None
    memo[a] = val
    return val


def switch_point(cmp: Any, rebuilt: Callable[[Any], bool], producer) -> tuple | None:
    """``(u, c)`` when the comparison ``cmp`` compares the rebuilt variable
    ``u`` with a constant ``c`` (a literal, or a broadcast of one), else None."""
    a, b = cmp.invars
    for u, v in ((a, b), (b, a)):
        if jx.is_literal(u) or not rebuilt(u) or not is_float_aval(jx.aval(u)):
            continue
        if not jx.is_literal(v) and rebuilt(v):
            return None
        c = _scalar(v, {}, producer, {})
        if c is None or not np.isfinite(c):
            return None
        return u, c
    return None


def continuous_at_switch(select: Any, u: Any, c: Any, producer) -> bool:
    """Whether every case of ``select`` takes one value where ``u == c``.

    The cases are evaluated as functions of ``u`` alone (through pointwise
    equations and literals); a case that reads anything else cannot be
    decided, and the select is then not proven continuous.
    """
    memo: dict = {}
    point = {u: np.asarray(c, dtype=jx.aval(u).dtype)}
    vals = [_scalar(x, point, producer, memo) for x in select.invars[1:]]
    if any(v is None for v in vals):
        return False
    vals = [np.asarray(v, dtype=np.float64) for v in vals]
    if not all(np.isfinite(v) for v in vals):
        return False
    eps = float(jnp.finfo(jx.aval(select.outvars[0]).dtype).eps)
    scale = max(1.0, *[abs(float(v)) for v in vals])
    return all(abs(float(v) - float(vals[0])) <= 8 * eps * scale for v in vals)
