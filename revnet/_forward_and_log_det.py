"""``forward_and_log_det``: a program's outputs and its log-determinant.

A normalizing flow needs ``log|det J|`` of its map. Flow libraries write each
layer's term by hand; revnet derives it from the program. The plan that
inverts a function solves each unknown from one equation with the others
known: ordered that way the Jacobian is block triangular, and ``log|det J|``
is the sum of each solved equation's local term (``log|f'(x)|`` for an
elementwise bijection, ``log|k|`` for a known factor, ``slogdet(W)`` per row
for a known square matrix, zero for additions of known values and layout ops,
the sum over steps for a ``scan``, the picked case's term for ``jnp.where``,
the devices' terms for a ``shard_map``, each distinct block once).
The terms are computed from the forward values in stable forms
(``log(1 - tanh(x)**2)`` as ``2 (log 2 - x - softplus(-2x))``), so the
result is plain JAX: it differentiates, jits and vmaps like the function.

Inside :func:`revnet.invertible` (pass the decorated function), the
log-determinant is one more output of the reversible call: its cotangent flows
back through the local terms while the backward pass rebuilds their inputs,
so a deep flow trains in memory that does not grow with depth. In a loop,
carry the running sum: ``total + log_det`` is inverted as ``total - log_det``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from revnet._engine import Storage, flat_call, known_args, log_det, plan_call, reads
from revnet.invertible import Invertible

__all__ = ["forward_and_log_det"]

# How a caller of forward_and_log_det gets a log-determinant of a program
# that mixes the batch's examples.
_WHOLE_MAP = "pass batch_ndim=0 for one log-determinant of the whole map"


def forward_and_log_det(
    fun: Callable[..., Any],
    *args: Any,
    known_argnums: int | Sequence[int] = (),
    batch_ndim: int = 0,
) -> tuple[Any, jax.Array]:
    """Returns ``(fun(*args), log|det J|)``, the log-determinant derived from
    ``fun``'s program.

    ``J`` is the Jacobian of the map from the arguments that are not known
    (every floating leaf, flattened) to the outputs: ``fun`` must be a
    bijection that revnet inverts (:func:`revnet.invertible`), with as many
    output elements as rebuilt input elements.

    By default the log-determinant is one scalar for the whole map (for a
    batch of independent examples, the sum of theirs). With ``batch_ndim=1``
    (the flow convention) it is one per example, of shape ``[batch]``: the
    leading ``batch_ndim`` axes of every rebuilt argument are the batch's, and
    revnet proves from the program that each example's outputs depend on that
    example alone (a reduction or reshape across the batch axis is refused).

    When ``fun`` is decorated with :func:`revnet.invertible`, the result is
    computed by one reversible call with the log-determinant as one more
    output, so its gradient costs memory that does not grow with depth.

    Example:

    >>> import jax.numpy as jnp, revnet
    >>> def coupling(w, x):
    ...     a, b = jnp.split(x, 2, -1)
    ...     s = jnp.tanh(a @ w)
    ...     return jnp.concatenate([a, b * jnp.exp(s) + s], -1)
    >>> w, x = 0.5 * jnp.eye(2), jnp.ones((3, 4))
    >>> y, ld = revnet.forward_and_log_det(
    ...     coupling, w, x, known_argnums=0, batch_ndim=1
    ... )
    >>> ld.shape
    (3,)
    >>> bool(jnp.allclose(ld, jnp.sum(jnp.tanh(x[:, :2] @ w), -1)))
    True

    Args:
      fun: the function, or a function decorated with
        :func:`revnet.invertible` (whose options are then used).
      *args: its arguments, pytrees of arrays.
      known_argnums: the positions of arguments the map does not act on
        (weights): they are constants of ``J`` and still get gradients.
      batch_ndim: how many leading axes of the rebuilt arguments are batch
        axes, with one log-determinant per example; 0 for one scalar.

    Returns:
      ``(outputs, log_det)``, ``log_det`` of the batch's shape (a scalar by
      default) in the inputs' floating dtype (at least float32).

    Raises:
      NotInvertibleError: if ``fun`` cannot be inverted, or a step has no
        log-determinant revnet can derive (a ``custom_ivjp`` function without
        ``deflogdet``, an ``all_gather``, a ``shard_map`` with
        ``check_vma=False`` whose values may be replicated, an inverse rule
        registered without ``log_det``): the message names the equation and
        its source line.
      ValueError: if the map is not square, a rebuilt input or an output is
        not floating, or the rebuilt arguments do not share ``batch_ndim``
        leading axes.
    """
    if (
        not isinstance(batch_ndim, int)
        or isinstance(batch_ndim, bool)
        or batch_ndim < 0
    ):
        raise ValueError(
            f"forward_and_log_det: batch_ndim must be a non-negative int, got "
            f"{batch_ndim!r}"
        )
    extra = known_args.argnums(known_argnums, "forward_and_log_det")
    return derive(fun, args, extra, batch_ndim, _WHOLE_MAP)


def derive(
    fun: Callable[..., Any],
    args: tuple,
    known_argnums: tuple[int, ...],
    batch_ndim: int,
    advice: str,
    *,
    aux: str | None = None,
) -> tuple[Any, jax.Array]:
    """:func:`forward_and_log_det`, its arguments checked, for callers with
    their own words for what a user can change (a front door's method takes no
    ``batch_ndim``).

    Args:
      fun: As for :func:`forward_and_log_det`.
      args: Its arguments.
      known_argnums: The positions of the known arguments, a tuple of ints.
      batch_ndim: As for :func:`forward_and_log_det`, a non-negative int.
      advice: What ends the refusal of a program that mixes the batch's
        examples: how to change the call or the program.
      aux: None; or, for a ``fun`` that returns ``(outputs, aux)`` (a layer's
        new state beside its output), the one-line refusal of an ``aux``
        computed from a rebuilt argument: ``aux`` is no part of the map, so
        the program must compute it from the known values alone (the
        parameters, the old state, the RNG keys).

    Returns:
      ``(outputs, log_det)``, as :func:`forward_and_log_det`; with ``aux``,
      ``((outputs, aux), log_det)``.

    Raises:
      ValueError: With ``aux``'s message, if the program computes ``aux``
        from a rebuilt argument.
    """
    if isinstance(fun, Invertible):
        known = tuple(sorted({*fun.known_argnums, *known_argnums}))
        inner = _WithLogDet(fun.fun, known, fun.storage, batch_ndim, advice, aux)
        return Invertible(inner, fun.storage, known)(*args)
    return _WithLogDet(fun, known_argnums, Storage(), batch_ndim, advice, aux)(*args)


class _WithLogDet:
    """``fun`` returning ``(outputs, log_det)``: the program evaluated with the
    terms of its inversion plan."""

    def __init__(
        self,
        fun: Callable[..., Any],
        known: tuple,
        storage: Storage,
        batch_ndim: int,
        advice: str,
        aux: str | None = None,
    ):
        self.fun, self.known, self.storage = fun, known, storage
        self.batch_ndim, self.advice, self.aux = batch_ndim, advice, aux
        self.__name__ = getattr(fun, "__name__", "function")

    def __call__(self, *args: Any) -> tuple[Any, jax.Array]:
        fname = self.__name__
        call = flat_call(self.fun, args, self.known, name=fname)
        flat_args, paths = call.args, call.paths()
        _check_floating(flat_args, paths, fname)
        k = self.batch_ndim
        batch = _batch_shape(flat_args, paths, k, fname) if k else None
        p = plan_call(call, self.storage)
        jaxpr, consts, out_tree = p.jaxpr, p.consts, p.out_tree
        n_out = len(jaxpr.outvars)
        if self.aux is not None:  # the leaves of ``outputs`` come first
            n_out = out_tree.children()[0].num_leaves
            flagged = [False] * len(consts) + [True] * len(flat_args)
            if any(reads(jaxpr, flagged)[n_out:]):
                raise ValueError(self.aux)
        dtype = _check_square(flat_args, jaxpr.outvars[:n_out], fname)

        def reduce(term, aval, eqn, shape):
            # ``shape``: the batch's (a shard_map body's blocks of it), or ().
            if jnp.ndim(term) != len(aval.shape):
                raise log_det.refusal(
                    eqn,
                    f"its log-determinant term has rank {jnp.ndim(term)} for an "
                    f"input of rank {len(aval.shape)}",
                )
            term = jnp.asarray(term).astype(dtype)
            summed = jnp.sum(term, tuple(range(len(shape), term.ndim)))
            return jnp.broadcast_to(summed, shape)

        zero = log_det.zero(flat_args, batch or (), dtype)
        outs, total = log_det.evaluate(
            p.plan,
            p.exposed.jaxpr,
            [*consts, *flat_args],
            reduce,
            zero,
            batch,
            n_out,
            self.advice,
        )
        outs = outs[: len(jaxpr.outvars)]
        return jax.tree_util.tree_unflatten(out_tree, outs), total


def _check_floating(flat_args, paths, fname: str) -> None:
    for leaf, path in zip(flat_args, paths):
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
            raise ValueError(
                f"forward_and_log_det({fname}): the rebuilt argument {path} is "
                f"{jnp.result_type(leaf)}; a log-determinant needs floating "
                "inputs (pass integer arguments in known_argnums)"
            )


def _batch_shape(flat_args, paths, k: int, fname: str) -> tuple:
    """The batch's shape: the leading ``k`` axes every rebuilt leaf shares."""
    shapes = [tuple(np.shape(leaf)) for leaf in flat_args]
    batch = shapes[0][:k] if shapes else ()
    for shape, path in zip(shapes, paths):
        if len(shape) < k or shape[:k] != batch:
            raise ValueError(
                f"forward_and_log_det({fname}): with batch_ndim={k}, every rebuilt "
                f"argument leads with the batch's axes {batch}, but {path} has "
                f"shape {shape}"
            )
    return batch


def _check_square(flat_args, outvars, fname: str) -> Any:
    """The log-determinant's dtype; refuses a map that is not square or has
    an output that is not floating."""
    for n, v in enumerate(outvars):
        if not jnp.issubdtype(v.aval.dtype, jnp.floating):
            raise ValueError(
                f"forward_and_log_det({fname}): output {n} is {v.aval.dtype}; a "
                "log-determinant needs floating outputs"
            )
    n_in = sum(int(np.size(leaf)) for leaf in flat_args)
    n_out = sum(int(np.prod(v.aval.shape)) for v in outvars)
    if n_in != n_out:
        raise ValueError(
            f"forward_and_log_det({fname}): the map takes {n_in} values to "
            f"{n_out}; a log-determinant needs as many outputs as rebuilt inputs"
        )
    dtype = jnp.result_type(
        *[jnp.result_type(leaf) for leaf in flat_args], *[v.aval.dtype for v in outvars]
    )
    return jnp.promote_types(dtype, jnp.float32)
