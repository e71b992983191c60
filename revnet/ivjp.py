"""``custom_ivjp``: a user-given inverse for one function.

revnet inverts a function equation by equation: the analysis (in
``revnet._engine``) solves each equation for its unknown input from its
outputs with the equation's *inverse rule*, and the backward pass rebuilds
inputs from outputs instead of storing them (see :mod:`revnet.invertible`).
There are two ways to teach it something it cannot invert by itself.

**A rule for a primitive.** :func:`register_inverse` adds (or replaces) the
inverse rule of one JAX primitive, used wherever that primitive appears::

    def sinh_inverse(outs, ins, **params):
        # outs: the equation's outputs; ins: its inputs, None where unknown;
        # params: the equation's params (accept and ignore extras).
        return [jnp.arcsinh(outs[0])]

    revnet.register_inverse(jax.extend.core.primitives.sinh_p, sinh_inverse)

A rule raises :class:`NotInvertibleError` with a short reason when it cannot
solve; the analysis calls it once on abstract values (``jax.eval_shape``), so
it must decide from shapes, dtypes and params alone. A rule that needs the
inputs' shapes declares a keyword ``in_avals``. The built-in rules are in
:mod:`revnet.rules`.

**An inverse for a whole function.** :class:`custom_ivjp` wraps a function
that the analysis cannot see through (a gather by a constant permutation, a
solver) and gives it an inverse, or a fused inverse-and-VJP rule. Inside an
``@invertible`` function it is one invertible equation; on its own it is a
``jax.custom_vjp`` that saves only its outputs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from revnet._engine import LRU, NotInvertibleError, cotangents, register_inverse, tag

__all__ = ["NotInvertibleError", "custom_ivjp", "register_inverse"]

# How many input shapes a custom_ivjp function remembers.
_TREES_SIZE = 64


class custom_ivjp:  # noqa: N801 - mirrors jax.custom_vjp
    """A function with a user-supplied inverse, usable like ``jax.custom_vjp``.

    Calling it runs ``fun`` forward and saves only its outputs (and the leading
    ``num_consts`` arguments); the backward pass rebuilds the inputs with the
    inverse and computes cotangents from them. Inside an
    :func:`revnet.invertible` function it is treated as one invertible equation.

    Exactly one of :meth:`definverse` and :meth:`defivjp` is needed:

    * ``definverse(inv)``: ``inv(outputs) -> inputs`` (a tuple of the positional
      inputs, or the bare input when there is one, mirroring ``f(x) -> y``);
      cotangents then come from ``jax.vjp`` of ``fun`` at the rebuilt inputs.
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

        scale.definverse(lambda y: y / 2.0)  # or (y / 2.0,)
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
        self.log_det_fn: Callable[..., Any] | None = None
        self.__name__ = getattr(fun, "__name__", "custom_ivjp")
        self.__doc__ = getattr(fun, "__doc__", None)
        # (in_tree, flat input shapes and dtypes) -> the _Signature of the calls
        # of that type, each with its own jax.custom_vjp; bounded, the most
        # recently used are kept. Nothing about one call is kept on ``self``:
        # a backward pass reads its call's arity from its own signature.
        self.trees = LRU(_TREES_SIZE)
        self._lock = threading.Lock()

    def definverse(self, inverse: Callable[..., Any]) -> Callable[..., Any]:
        """Sets ``inverse(outputs) -> inputs`` (``inverse(consts, outputs)`` with
        constants); returns it, so it can be used as a decorator."""
        self.inverse_fn = inverse
        return inverse

    def defivjp(self, ivjp: Callable[..., Any]) -> Callable[..., Any]:
        """Sets the fused rule ``ivjp(outputs, output_cts) -> (inputs, input_cts)``;
        returns it."""
        self.ivjp_fn = ivjp
        return ivjp

    def deflogdet(self, log_det: Callable[..., Any]) -> Callable[..., Any]:
        """Sets ``log_det(*args)``, the log-determinant of the function's map
        from its inputs after the constants to its outputs, for
        :func:`revnet.forward_and_log_det`: a scalar, or one value per example
        (of the batch's shape) for ``batch_ndim``. An array whose shape leads
        with the batch's (one term per position, say) is summed over its
        other axes; without ``batch_ndim``, over all of them. Returns it."""
        self.log_det_fn = log_det
        return log_det

    def log_det(self, args: tuple) -> Any:
        """The user's log-determinant at the positional arguments ``args``, or
        None when none was given."""
        return None if self.log_det_fn is None else self.log_det_fn(*args)

    # The pieces the interpreters use (through a call's _Signature, which
    # gives ``n_args``). ``consts`` is a tuple (maybe empty).

    def _call_rule(self, rule, consts, *rest):
        return rule(consts, *rest) if self.num_consts else rule(*rest)

    def invert(self, consts: tuple, outputs: Any, n_args: int) -> tuple:
        """The inputs after the constants, rebuilt from ``outputs`` of a call
        with ``n_args`` positional arguments."""
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
        return self._as_tuple(inputs, "inverse", n_args - self.num_consts)

    def ivjp(
        self, consts: tuple, outputs: Any, cts: Any, n_args: int
    ) -> tuple[tuple, tuple]:
        """Rebuilds the inputs and returns ``(inputs, cotangents of all args)``."""
        if self.ivjp_fn is not None:
            inputs, in_cts = self._call_rule(self.ivjp_fn, consts, outputs, cts)
            return (
                self._as_tuple(inputs, "ivjp", n_args - self.num_consts),
                self._as_tuple(in_cts, "ivjp", n_args),
            )
        inputs = self.invert(consts, outputs, n_args)
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
        flat, in_tree = jax.tree_util.tree_flatten(args)
        key = tuple((tuple(np.shape(a)), str(jnp.result_type(a))) for a in flat)
        with self._lock:
            sig = self.trees.get((in_tree, key))
            if sig is None:
                sig = _Signature(self, len(args), key, in_tree)
                self.trees.put((in_tree, key), sig)
        out = sig.vjp_fun(*args)
        sig.record(jax.tree_util.tree_structure(out))
        return out

    def _as_tuple(self, x: Any, what: str, n: int) -> tuple:
        """``x`` as a tuple of ``n`` entries; a bare value when ``n`` is 1."""
        if n == 1 and not (isinstance(x, (tuple, list)) and len(x) == 1):
            return (x,)
        if not isinstance(x, (tuple, list)):
            raise TypeError(
                f"the {what} rule of custom_ivjp function {self.__name__!r} must "
                f"return a tuple with one entry per positional input, got "
                f"{type(x).__name__}"
            )
        return tuple(x)


class _Signature:
    """The calls of a ``custom_ivjp`` function with one input type.

    It holds the ``jax.custom_vjp`` those calls run, whose backward is tagged
    with this object: the engine reads the call's equation through it
    (``num_consts``, ``trees``: flat input shapes -> ``(in_tree, out_tree)``,
    ``invert(consts, outputs)``, ``ivjp(consts, outputs, cts)``,
    ``log_det(args)``, ``user_vjp``, ``remade``), and both the
    engine and the backward pass get the call's arity from it, never from the
    function object, which other calls (other threads) share.
    """

    remade = ()  # no input is made again by the function (ivjp_replay)

    def __init__(self, fn: custom_ivjp, n_args: int, key: tuple, in_tree: Any):
        self.fn = fn
        self.__name__ = fn.__name__
        self.num_consts = fn.num_consts
        self.n_args = n_args
        self.key = key
        self.in_tree = in_tree
        self.trees: dict = {}
        self.vjp_fun = self._make_vjp_fun()

    @property
    def user_vjp(self) -> bool:
        """Whether the cotangents are the user's own (a fused ``defivjp``
        rule), not ``jax.vjp`` of ``fun`` at the rebuilt inputs."""
        return self.fn.ivjp_fn is not None

    def record(self, out_tree: Any) -> None:
        self.trees = {self.key: (self.in_tree, out_tree)}

    def invert(self, consts: tuple, outputs: Any) -> tuple:
        return self.fn.invert(consts, outputs, self.n_args)

    def ivjp(self, consts: tuple, outputs: Any, cts: Any) -> tuple[tuple, tuple]:
        return self.fn.ivjp(consts, outputs, cts, self.n_args)

    def log_det(self, args: tuple) -> Any:
        return self.fn.log_det(args)

    def _make_vjp_fun(self):
        nc = self.num_consts
        fn = self.fn

        @jax.custom_vjp
        def f(*args):
            return fn.fun(*args)

        def fwd(*args):
            out = fn.fun(*args)
            return out, (tuple(args[:nc]), out)

        def bwd(res, cts):
            consts, out = res
            inputs, in_cts = self.ivjp(consts, out, cts)
            return cotangents.float0_for_ints((*consts, *inputs), in_cts)

        tag(bwd, self)  # the analysis solves this function by its inverse
        f.defvjp(fwd, bwd)
        return f
