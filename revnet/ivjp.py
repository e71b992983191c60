"""Inverse rules: how to run a single primitive backwards.

An *inverse rule* solves one equation for the inputs that are not known, given
its outputs and its known inputs. It is a plain function::

    def rule(outs, ins, **params):
        # outs: list of the equation's output values (all known).
        # ins:  list of its input values, ``None`` where unknown.
        # params: the equation's params (accept and ignore extras).
        return new_ins  # the full list of input values

A rule raises :class:`NotInvertibleError` with a short reason when the equation
cannot be solved for the unknown inputs (for example ``mul`` with two unknown
operands, or ``add`` whose unknown operand was broadcast). The analysis in
:mod:`revnet.invertible` calls every rule once on abstract values
(``jax.eval_shape``) to decide invertibility at trace time, so a rule must
decide from shapes, dtypes and params alone whether it applies, never from
values.

Register a rule for a primitive with :func:`register_inverse`; the built-in
rules below use the same mechanism, grouped by family as in ``jax.lax``. Rules
are built from ``jax.lax`` functions, so they trace, jit and vmap like any
JAX code.

:func:`custom_ivjp` is the escape hatch for functions the analysis cannot invert
equation by equation: give it an inverse, or a fused inverse-and-VJP rule.

Example::

    import revnet
    from jax.extend.core import primitives

    def sinh_inverse(outs, ins, **params):
        (y,) = outs
        return [jax.numpy.arcsinh(y)]

    revnet.register_inverse(primitives.sinh_p, sinh_inverse)  # already built in
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

InverseRuleFn = Callable[..., Sequence[Any]]


class NotInvertibleError(ValueError):
    """Raised when a function cannot be inverted equation by equation.

    The message names the primitive, the input that could not be recovered and,
    where known, the user's source line.
    """


@dataclasses.dataclass(frozen=True)
class InverseRule:
    """A registered rule.

    Attributes:
      solve: ``solve(outs, ins, **params) -> ins`` (see the module docstring).
      vjp: optional fused cotangent rule ``vjp(ins, outs, out_cts, **params) ->
        in_cts``; when absent the equation's own VJP is used.
      check: optional trace-time check ``check(statics, **params)``, called by
        the analysis only; ``statics`` holds the concrete value of each known
        input that is fixed at trace time (a literal, or computed from
        literals), ``None`` for the others. It raises
        :class:`NotInvertibleError` when such a value makes the equation lose
        information (a multiplication by a constant zero).
    """

    solve: InverseRuleFn
    vjp: Callable[..., Sequence[Any]] | None = None
    check: Callable[..., None] | None = None


_RULES: dict[str, InverseRule] = {}


def _primitive_name(primitive: Any) -> str:
    if isinstance(primitive, str):
        return primitive
    name = getattr(primitive, "name", None)
    if not isinstance(name, str):
        raise TypeError(
            "register_inverse expects a JAX primitive or its name, got "
            f"{type(primitive).__name__}"
        )
    return name


def register_inverse(
    primitive: Any, rule: InverseRuleFn, check: Callable[..., None] | None = None
) -> None:
    """Registers (or replaces) the inverse rule of ``primitive``.

    Args:
      primitive: a JAX primitive (``jax.extend.core.primitives.exp_p``) or its
        name (``"exp"``).
      rule: ``rule(outs, ins, **params) -> ins``; ``ins`` holds ``None`` for the
        unknown inputs. Raise :class:`NotInvertibleError` when it cannot solve.
      check: optional ``check(statics, **params)``, run at trace time with the
        known inputs whose values are fixed then (``None`` for the others);
        raise :class:`NotInvertibleError` when those values lose information.

    Raises:
      TypeError: if ``primitive`` is neither a primitive nor a name, or ``rule``
        is not callable.
    """
    if not callable(rule):
        raise TypeError(f"register_inverse expects a callable rule, got {rule!r}")
    if check is not None and not callable(check):
        raise TypeError(f"register_inverse expects a callable check, got {check!r}")
    _RULES[_primitive_name(primitive)] = InverseRule(rule, check=check)


def get_rule(name: str) -> InverseRule | None:
    return _RULES.get(name)


# --------------------------------------------------------------------------- #
# Helpers shared by the rules.


def _unknown(ins: Sequence[Any]) -> list[int]:
    return [i for i, v in enumerate(ins) if v is None]


def _one_unknown(ins: Sequence[Any], what: str = "operand") -> int:
    idx = _unknown(ins)
    if len(idx) != 1:
        raise NotInvertibleError(
            f"{len(idx)} {what}s are unknown; an equation can be solved for one"
        )
    return idx[0]


def _check_not_broadcast(unknown_shape: Sequence[int], out: Any) -> None:
    if tuple(unknown_shape) != tuple(out.shape):
        raise NotInvertibleError(
            f"the unknown operand of shape {tuple(unknown_shape)} was broadcast to "
            f"{tuple(out.shape)}"
        )


def _with(ins: Sequence[Any], i: int, value: Any) -> list[Any]:
    out = list(ins)
    out[i] = value
    return out


# The analysis passes the avals of unknown inputs through ``shapes``.
_SHAPES = "_revnet_in_avals"


def _in_aval(params: dict, i: int) -> Any:
    return params[_SHAPES][i]


# --------------------------------------------------------------------------- #
# Arithmetic: add, sub, neg, mul, div.


def _binary(solve: Callable[[Any, Any, int], Any], what: str = "") -> InverseRuleFn:
    """A rule for ``y = a op b`` solving the one unknown operand.

    ``solve(y, known, i)`` returns operand ``i`` from the output and the other
    operand. With ``what``, integer operands are refused (``what`` names the
    operation in the message).
    """

    def rule(outs, ins, **params):
        (y,) = outs
        i = _one_unknown(ins)
        a = _in_aval(params, i)
        _check_not_broadcast(a.shape, y)
        if what and not jnp.issubdtype(a.dtype, jnp.inexact):
            raise NotInvertibleError(f"integer {what} is not invertible")
        return _with(ins, i, solve(y, ins[1 - i], i))

    return rule


_add = _binary(lambda y, k, i: y - k)
_sub = _binary(lambda y, k, i: k - y if i == 1 else y + k)
_mul = _binary(lambda y, k, i: y / k, "multiplication")
_div = _binary(lambda y, k, i: y * k if i == 0 else k / y, "division")


def _neg(outs, ins, **params):
    return [-outs[0]]


def _has_zero(x: Any) -> bool:
    return x is not None and bool(np.any(np.asarray(x) == 0))


def _check_mul(statics, **params):
    for k in statics:
        if _has_zero(k):
            raise NotInvertibleError(
                "multiplication by a constant zero loses the other operand"
            )


def _check_div(statics, **params):
    num, den = statics
    if _has_zero(den):
        raise NotInvertibleError("division by a constant zero loses the numerator")
    if _has_zero(num):
        raise NotInvertibleError("a constant zero divided by a value loses the value")


for _name, _fn, _check in [
    ("add", _add, None),
    ("add_any", _add, None),
    ("sub", _sub, None),
    ("neg", _neg, None),
    ("mul", _mul, _check_mul),
    ("div", _div, _check_div),
]:
    register_inverse(_name, _fn, _check)


# --------------------------------------------------------------------------- #
# Elementwise bijections.


def _unary(inverse: Callable[[Any], Any]) -> InverseRuleFn:
    def rule(outs, ins, **params):
        return [inverse(outs[0])]

    return rule


def _logit(y):
    return jnp.log(y) - jnp.log1p(-y)


_UNARY = {
    "exp": jnp.log,
    "log": jnp.exp,
    "exp2": jnp.log2,
    "log1p": jnp.expm1,
    "expm1": jnp.log1p,
    "tanh": jnp.arctanh,
    "atanh": jnp.tanh,
    "logistic": _logit,
    "sinh": jnp.arcsinh,
    "asinh": jnp.sinh,
    "sqrt": lambda y: y * y,
    "rsqrt": lambda y: 1.0 / (y * y),
    "cbrt": lambda y: y * y * y,
    "copy": lambda y: y,
    "copy_p": lambda y: y,
    "erf_inv": lax.erf,
}
for _name, _inv in _UNARY.items():
    register_inverse(_name, _unary(_inv))


def _integer_pow(outs, ins, *, y, **params):
    (out,) = outs
    if y % 2 == 0 or y == 0:
        raise NotInvertibleError(f"x ** {y} is not invertible (even power)")
    if y < 0:
        out = 1.0 / out
    n = abs(y)
    if n == 1:
        return [out]
    return [jnp.sign(out) * jnp.abs(out) ** (1.0 / n)]


register_inverse("integer_pow", _integer_pow)


def _is_widening(src: Any, dst: Any) -> bool:
    """Whether every value of float dtype ``src`` is exactly a value of ``dst``."""
    if np.dtype(src) == np.dtype(dst):
        return True
    if jnp.issubdtype(src, jnp.complexfloating) != jnp.issubdtype(
        dst, jnp.complexfloating
    ):
        return False
    a, b = jnp.finfo(src), jnp.finfo(dst)
    return (
        b.nmant >= a.nmant
        and b.maxexp >= a.maxexp
        and b.minexp <= a.minexp
        and b.nexp >= a.nexp
    )


def _convert_element_type(outs, ins, *, new_dtype, **params):
    a = _in_aval(params, 0)
    if not (
        jnp.issubdtype(a.dtype, jnp.inexact) and jnp.issubdtype(new_dtype, jnp.inexact)
    ):
        raise NotInvertibleError(
            f"conversion from {a.dtype} to {np.dtype(new_dtype)} is invertible only "
            "between floating types"
        )
    if not _is_widening(a.dtype, new_dtype):
        raise NotInvertibleError(
            f"conversion from {a.dtype} to {np.dtype(new_dtype)} rounds values "
            "(narrowing); only widening conversions can be undone"
        )
    return [lax.convert_element_type(outs[0], a.dtype)]


register_inverse("convert_element_type", _convert_element_type)


def _cumsum(outs, ins, *, axis, reverse=False, **params):
    (y,) = outs
    n = y.shape[axis]
    if n == 0:
        return [y]
    if reverse:
        shifted = lax.slice_in_dim(y, 1, n, axis=axis)
        pad = [(0, 0, 0)] * y.ndim
        pad[axis] = (0, 1, 0)
    else:
        shifted = lax.slice_in_dim(y, 0, n - 1, axis=axis)
        pad = [(0, 0, 0)] * y.ndim
        pad[axis] = (1, 0, 0)
    return [y - lax.pad(shifted, jnp.zeros((), y.dtype), pad)]


register_inverse("cumsum", _cumsum)


# --------------------------------------------------------------------------- #
# Shape and layout.


def _reshape(outs, ins, **params):
    return [jnp.reshape(outs[0], _in_aval(params, 0).shape)]


def _transpose(outs, ins, *, permutation, **params):
    return [lax.transpose(outs[0], tuple(np.argsort(permutation)))]


def _broadcast_in_dim(outs, ins, *, shape, broadcast_dimensions, **params):
    a = _in_aval(params, 0)
    if int(np.prod(a.shape)) != int(np.prod(shape)):
        raise NotInvertibleError(
            f"broadcast from {tuple(a.shape)} to {tuple(shape)} copies values; only "
            "broadcasts that add unit dimensions are invertible"
        )
    return [jnp.reshape(outs[0], a.shape)]


def _rev(outs, ins, *, dimensions, **params):
    return [lax.rev(outs[0], dimensions)]


def _concatenate(outs, ins, *, dimension, **params):
    (y,) = outs
    new, start = list(ins), 0
    for i in range(len(ins)):
        size = _in_aval(params, i).shape[dimension]
        if ins[i] is None:
            new[i] = lax.slice_in_dim(y, start, start + size, axis=dimension)
        start += size
    return new


def _split(outs, ins, *, axis, **params):
    return [lax.concatenate(list(outs), axis)]


def _select_n(outs, ins, **params):
    # select_n(pred, *cases): with a known predicate, an unknown case is only
    # determined where it is selected, so a single unknown case is solvable
    # only when every case is the same variable (handled by the analysis) or
    # there is exactly one case.
    if ins[0] is None:
        raise NotInvertibleError("the predicate of select_n is unknown")
    if len(ins) == 2:
        return [ins[0], outs[0]]
    raise NotInvertibleError(
        "select_n with an unknown case is determined only where that case is selected"
    )


for _name, _fn in [
    ("reshape", _reshape),
    ("squeeze", _reshape),
    ("expand_dims", _reshape),
    ("transpose", _transpose),
    ("broadcast_in_dim", _broadcast_in_dim),
    ("rev", _rev),
    ("concatenate", _concatenate),
    ("split", _split),
    ("select_n", _select_n),
]:
    register_inverse(_name, _fn)


# --------------------------------------------------------------------------- #
# Linear algebra: dot_general with a known square matrix, solved.


def _dot_general(outs, ins, *, dimension_numbers, **params):
    (y,) = outs
    i = _one_unknown(ins)
    (lc, rc), (lb, rb) = dimension_numbers
    if lb or rb:
        raise NotInvertibleError("dot_general with batch dimensions is not supported")
    if len(lc) != 1:
        raise NotInvertibleError("dot_general must contract exactly one dimension")
    m = ins[1 - i]
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise NotInvertibleError(
            f"the known operand of dot_general must be a square matrix, got shape "
            f"{tuple(m.shape)}"
        )
    x_aval = _in_aval(params, i)
    if not jnp.issubdtype(x_aval.dtype, jnp.inexact):
        raise NotInvertibleError("integer dot_general is not invertible")
    n = m.shape[0]
    cx = (lc if i == 0 else rc)[0]
    cm = (rc if i == 0 else lc)[0]
    if n == 0 or 0 in y.shape:  # nothing to solve for
        return _with(ins, i, jnp.zeros(x_aval.shape, x_aval.dtype))
    # Solve in at least float32 (LAPACK has no half-precision solvers).
    solve_dtype = jnp.promote_types(y.dtype, jnp.float32)
    y = y.astype(solve_dtype)
    mat = m.astype(solve_dtype)
    # Bring the product to the form  Y[..., j] = sum_k X[..., k] A[k, j].
    a = mat if cm == 0 else mat.T
    if i == 0:  # y dims: x free dims..., m free dim
        y2 = y
    else:  # y dims: m free dim, x free dims...
        y2 = jnp.moveaxis(y, 0, -1)
    batch_shape = y2.shape[:-1]
    flat = y2.reshape((-1, n))
    # X A = Y  <=>  A^T X^T = Y^T.
    x_flat = jnp.linalg.solve(a.T, flat.T).T
    x_moved = x_flat.reshape((*batch_shape, n)).astype(x_aval.dtype)
    return _with(ins, i, jnp.moveaxis(x_moved, -1, cx))


def _check_dot_general(statics, **params):
    for m in statics:
        if m is None:
            continue
        m = np.asarray(m, np.float64)
        if m.ndim == 2 and m.shape[0] == m.shape[1] and m.size:
            if np.linalg.matrix_rank(m) < m.shape[0]:
                raise NotInvertibleError(
                    "the constant matrix of dot_general is singular"
                )


register_inverse("dot_general", _dot_general, _check_dot_general)


# --------------------------------------------------------------------------- #
# custom_ivjp: user-supplied inverses for whole functions.


_BWD_TAG = "_revnet_custom_ivjp"


class custom_ivjp:  # noqa: N801 - mirrors jax.custom_vjp
    """A function with a user-supplied inverse, usable like ``jax.custom_vjp``.

    Calling it runs ``fun`` forward and saves only its outputs (and the leading
    ``num_consts`` arguments); the backward pass rebuilds the inputs with the
    inverse and computes cotangents from them. Inside an
    :func:`revnet.invertible` function it is treated as one invertible equation.

    Exactly one of :meth:`definverse` and :meth:`defivjp` is needed:

    * ``definverse(inv)``: ``inv(outputs) -> inputs`` (a tuple of the positional
      inputs); cotangents then come from ``jax.vjp`` of ``fun`` at the rebuilt
      inputs.
    * ``defivjp(ivjp)``: a fused rule ``ivjp(outputs, output_cts) -> (inputs,
      input_cts)``; ``input_cts`` is a tuple with one cotangent per positional
      argument. With only ``defivjp`` the inverse is the rule's first result.

    With ``num_consts > 0`` the first ``num_consts`` positional arguments are
    known constants (weights): they are saved, never rebuilt, and get
    cotangents; the rules then take them as an extra first argument:
    ``inv(consts, outputs)`` and ``ivjp(consts, outputs, output_cts)``, and
    ``inputs`` lists only the remaining arguments while ``input_cts`` covers
    all positional arguments, constants first.

    Example::

        @revnet.custom_ivjp
        def scale(x):
            return 2.0 * x

        scale.definverse(lambda y: (y / 2.0,))
        jax.grad(lambda x: scale(x).sum())(jnp.ones(3))

    Args:
      fun: the function; positional arguments and outputs are pytrees of arrays.
      num_consts: how many leading arguments are known constants.
    """

    def __init__(self, fun: Callable[..., Any], num_consts: int = 0):
        if not callable(fun):
            raise TypeError(f"custom_ivjp expects a callable, got {fun!r}")
        if not isinstance(num_consts, int) or num_consts < 0:
            raise ValueError(
                f"num_consts must be a non-negative int, got {num_consts!r}"
            )
        self.fun = fun
        self.num_consts = num_consts
        self.inverse_fn: Callable[..., Any] | None = None
        self.ivjp_fn: Callable[..., Any] | None = None
        self.__name__ = getattr(fun, "__name__", "custom_ivjp")
        self.__doc__ = getattr(fun, "__doc__", None)
        self._vjp_fun = None
        # (flat input shapes and dtypes) -> (in_tree, out_tree), recorded at each
        # call so that the analysis can rebuild pytrees from a jaxpr equation.
        self.trees: dict = {}

    def definverse(self, inverse: Callable[..., Any]) -> Callable[..., Any]:
        """Sets ``inverse(outputs) -> inputs`` (``inverse(consts, outputs)`` with
        constants); returns it, so it can be used as a decorator."""
        self.inverse_fn = inverse
        self._vjp_fun = None
        return inverse

    def defivjp(self, ivjp: Callable[..., Any]) -> Callable[..., Any]:
        """Sets the fused rule ``ivjp(outputs, output_cts) -> (inputs, input_cts)``;
        returns it."""
        self.ivjp_fn = ivjp
        self._vjp_fun = None
        return ivjp

    # The pieces the interpreters use. ``consts`` is a tuple (maybe empty).

    def _call_rule(self, rule, consts, *rest):
        return rule(consts, *rest) if self.num_consts else rule(*rest)

    def invert(self, consts: tuple, outputs: Any) -> tuple:
        if self.inverse_fn is not None:
            inputs = self._call_rule(self.inverse_fn, consts, outputs)
        elif self.ivjp_fn is not None:
            zeros = jax.tree_util.tree_map(jnp.zeros_like, outputs)
            inputs = self._call_rule(self.ivjp_fn, consts, outputs, zeros)[0]
        else:
            raise NotInvertibleError(
                f"custom_ivjp function {self.__name__!r} has neither definverse nor "
                "defivjp"
            )
        return _as_tuple(inputs, "inverse", self.__name__)

    def ivjp(self, consts: tuple, outputs: Any, cts: Any) -> tuple[tuple, tuple]:
        """Rebuilds the inputs and returns ``(inputs, cotangents of all args)``."""
        if self.ivjp_fn is not None:
            inputs, in_cts = self._call_rule(self.ivjp_fn, consts, outputs, cts)
            return (
                _as_tuple(inputs, "ivjp", self.__name__),
                _as_tuple(in_cts, "ivjp", self.__name__),
            )
        inputs = self.invert(consts, outputs)
        _, vjp = jax.vjp(self.fun, *consts, *inputs)
        return inputs, tuple(vjp(cts))

    def __call__(self, *args: Any) -> Any:
        if self.inverse_fn is None and self.ivjp_fn is None:
            raise NotInvertibleError(
                f"custom_ivjp function {self.__name__!r} needs definverse or defivjp "
                "before it is called"
            )
        if len(args) < self.num_consts:
            raise TypeError(
                f"{self.__name__} takes at least {self.num_consts} positional "
                f"arguments (num_consts), got {len(args)}"
            )
        if self._vjp_fun is None:
            self._vjp_fun = self._make_vjp_fun()
        flat, in_tree = jax.tree_util.tree_flatten(args)
        out = self._vjp_fun(*args)
        key = tuple((tuple(np.shape(a)), str(jnp.result_type(a))) for a in flat)
        self.trees[key] = (in_tree, jax.tree_util.tree_structure(out))
        return out

    def _make_vjp_fun(self):
        nc = self.num_consts

        @jax.custom_vjp
        def f(*args):
            return self.fun(*args)

        def fwd(*args):
            out = self.fun(*args)
            return out, (tuple(args[:nc]), out)

        def bwd(res, cts):
            consts, out = res
            inputs, in_cts = self.ivjp(consts, out, cts)
            return float0_for_ints((*consts, *inputs), in_cts)

        setattr(bwd, _BWD_TAG, self)
        f.defvjp(fwd, bwd)
        return f


def _as_tuple(x: Any, what: str, name: str) -> tuple:
    if not isinstance(x, (tuple, list)):
        raise TypeError(
            f"the {what} rule of custom_ivjp function {name!r} must return a tuple "
            f"with one entry per positional input, got {type(x).__name__}"
        )
    return tuple(x)


def float0_for_ints(primals: Any, cts: Any) -> Any:
    """Replaces the cotangents of non-float leaves of ``primals`` by float0 zeros."""

    def fix(p, ct):
        if jnp.issubdtype(jnp.result_type(p), jnp.inexact):
            return ct
        return np.zeros(np.shape(p), jax.dtypes.float0)

    return jax.tree_util.tree_map(fix, tuple(primals), tuple(cts))


def custom_ivjp_of(bwd: Any) -> custom_ivjp | None:
    """The :class:`custom_ivjp` whose backward function is ``bwd``, if any."""
    return getattr(bwd, _BWD_TAG, None)
