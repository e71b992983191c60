"""ReversibleSequence: a stack of invertible blocks with O(1) activation memory.

The layers' parameters are stacked on a leading axis (as ``hk.layer_stack``
does) and run with ``lax.scan``. In reversible mode the whole stack is ONE
``jax.custom_vjp``: its forward pass saves only the final output (parameters,
state and RNG keys are inputs anyway), and its backward pass is a reverse
``lax.scan`` that, per block, rebuilds the block's input from its output and
takes the VJP of the same evaluations (see ``coupling.AdditiveRule.backward``).
Activation memory and compile time are therefore independent of depth.

With ``reversible=False`` the very same parameters run through the very same
forward scan under ordinary autodiff: the honest baseline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from revnet.blocks import _tape
from revnet.blocks._checks import (
    check_bool,
    check_callable,
    check_input,
    check_int,
    check_name,
    show,
)
from revnet.blocks._lift import Lifted

BlockFn = Callable[..., jax.Array]


class BlockRule(NamedTuple):
    """One shape-preserving block, run through its Haiku ``apply``.

    ``aux`` is ``(state, rng)``.
    """

    apply: Callable[..., tuple[jax.Array, Any]]
    name: str

    def forward(self, params, aux, x):
        state, key = aux
        y, state = self.apply(params, state, key, x)
        if y.shape != x.shape or y.dtype != x.dtype:
            raise ValueError(
                f"{self.name}: each block must preserve its input's shape and dtype; "
                f"got {x.shape} {x.dtype} -> {y.shape} {y.dtype}."
            )
        return y, state

    def _record(self, aux, spec):
        state, key = aux
        return lambda p: _tape.trace(lambda h: self.apply(p, state, key, h)[0], spec)

    def inverse(self, params, aux, y):
        return _tape.inverse(self._record(aux, y)(params), y)

    def backward(self, params, aux, y, dy):
        return _tape.fused_backward(self._record(aux, y), params, y, dy)


class ScanRule(NamedTuple):
    """``num_layers`` copies of one block, parameters stacked on axis 0.

    ``aux`` is ``(stacked_state, stacked_rng)``.
    """

    layer: BlockRule

    def forward(self, params, aux, x):
        def body(h, layer_args):
            p, s, k = layer_args
            return self.layer.forward(p, (s, k), h)

        return jax.lax.scan(body, x, (params, *aux))

    def inverse(self, params, aux, y):
        def body(h, layer_args):
            p, s, k = layer_args
            return self.layer.inverse(p, (s, k), h), None

        return jax.lax.scan(body, y, (params, *aux), reverse=True)[0]

    def backward(self, params, aux, y, dy):
        def body(carry, layer_args):
            p, s, k = layer_args
            x, dx, dp = self.layer.backward(p, (s, k), *carry)
            return (x, dx), dp

        (x, dx), dparams = jax.lax.scan(body, (y, dy), (params, *aux), reverse=True)
        return x, dx, dparams


class ChainRule(NamedTuple):
    """Different blocks one after another; ``params`` and ``aux`` are tuples."""

    layers: tuple[BlockRule, ...]

    def forward(self, params, aux, x):
        states = []
        for layer, p, s, k in zip(self.layers, params, *aux, strict=True):
            x, s = layer.forward(p, (s, k), x)
            states.append(s)
        return x, tuple(states)

    def inverse(self, params, aux, y):
        for layer, p, s, k in reversed(
            list(zip(self.layers, params, *aux, strict=True))
        ):
            y = layer.inverse(p, (s, k), y)
        return y

    def backward(self, params, aux, y, dy):
        grads = []
        for layer, p, s, k in reversed(
            list(zip(self.layers, params, *aux, strict=True))
        ):
            y, dy, dp = layer.backward(p, (s, k), y, dy)
            grads.append(dp)
        return y, dy, tuple(reversed(grads))


def zero_cotangent(tree: Any) -> Any:
    """Zero cotangents for ``tree``: ``float0`` for integer and key leaves."""

    def zero(leaf):
        dtype = jnp.result_type(leaf)
        if jnp.issubdtype(dtype, jnp.inexact):
            return jnp.zeros(jnp.shape(leaf), dtype)
        return np.zeros(jnp.shape(leaf), jax.dtypes.float0)

    return jax.tree.map(zero, tree)


def reversible_apply(
    rule: _tape.Rule, params: Any, aux: Any, x: jax.Array
) -> tuple[jax.Array, Any]:
    """Runs ``rule.forward`` under a custom VJP that stores only the output.

    Args:
      rule: An invertible rule with a fused ``backward``.
      params: Differentiable parameters.
      aux: State and RNG keys; they get zero (``float0`` for integers)
        cotangents.
      x: The input.

    Returns:
      ``(y, new_state)``. The new state gets no cotangent.
    """

    @jax.custom_vjp
    def run(params, aux, x):
        return rule.forward(params, aux, x)

    def run_fwd(params, aux, x):
        y, new_state = rule.forward(params, aux, x)
        return (y, new_state), (params, aux, y)

    def run_bwd(residuals, cotangents):
        params, aux, y = residuals
        dy, _ = cotangents
        _, dx, dparams = rule.backward(params, aux, y, dy)
        return dparams, zero_cotangent(aux), dx

    run.defvjp(run_fwd, run_bwd)
    return run(params, aux, x)


def _check_static(module: str, args: Any) -> None:
    for leaf in jax.tree.leaves(args):
        if isinstance(leaf, (jax.Array, np.ndarray)):
            raise TypeError(
                f"{module}: extra arguments to the block function must be static "
                f"Python values (such as is_training), got an array {leaf.shape}."
            )


class ReversibleSequence(hk.Module):
    """A stack of invertible blocks whose backward pass stores no activations.

    ``block_fn(x, *args, **kwargs) -> y`` builds and applies one invertible,
    shape-preserving block made of revnet invertible modules (as with
    ``hk.layer_stack``). ``num_layers`` copies of it run in a scan over
    parameters stacked on a leading axis.

    In reversible mode the backward pass rebuilds each block's input from its
    output, so activation memory does not grow with depth. Differentiate it in
    reverse mode only (``jax.grad``, ``jax.vjp``): a ``jax.custom_vjp`` cannot
    be differentiated in forward mode (``jax.jvp``, ``jax.jacfwd``).

    Example:

    >>> def model(x):
    ...   mlp = lambda h: hk.nets.MLP([16, 4])(h)
    ...   block = lambda h: AdditiveCoupling(mlp, mlp)(h)
    ...   return ReversibleSequence(block, num_layers=8)(x)
    >>> model = hk.transform(model)
    >>> x = jnp.ones([2, 8])
    >>> params = model.init(jax.random.PRNGKey(0), x)
    >>> jax.grad(lambda p: model.apply(p, None, x).sum())(params) is not None
    True
    """

    def __init__(
        self,
        block_fn: BlockFn | Sequence[BlockFn],
        num_layers: int | None = None,
        reversible: bool = True,
        name: str | None = None,
    ):
        """Constructs the sequence.

        Args:
          block_fn: Function building and applying one block, or a list of such
            functions for a heterogeneous stack (run one after another; activation
            memory stays constant in depth, compile time grows with the list).
          num_layers: Number of copies of ``block_fn``; leave out with a list.
          reversible: If False, run the same parameters with ordinary backprop.
          name: Name of the module.

        Raises:
          TypeError: If ``block_fn`` is neither a callable nor a list of
            callables, ``num_layers`` is not an integer (a bool or a float), or
            ``reversible`` is not a bool.
          ValueError: If ``num_layers`` is missing, not positive, or given with a
            list of block functions.
        """
        check_name(type(self), name)
        super().__init__(name=name)
        module = self.module_name
        self.reversible = check_bool(module, "reversible", reversible)
        if callable(block_fn):
            if num_layers is None:
                raise ValueError(
                    f"{module}: num_layers must be a positive integer with a single "
                    "block_fn, got None."
                )
            self.num_layers = check_int(module, "num_layers", num_layers)
            self._lifted = (
                Lifted(block_fn, self, "layers", num_stacked=self.num_layers),
            )
        else:
            expected = "a callable or a non-empty list of callables"
            if isinstance(block_fn, (str, bytes)) or not isinstance(block_fn, Sequence):
                raise TypeError(
                    f"{module}: block_fn must be {expected}, got {show(block_fn)}."
                )
            block_fns = list(block_fn)
            for i, fn in enumerate(block_fns):
                check_callable(module, f"block_fn[{i}]", fn)
            if num_layers is not None or not block_fns:
                raise ValueError(
                    f"{module}: with a list of block functions leave out "
                    f"num_layers and give at least one function, got "
                    f"{len(block_fns)} functions and num_layers={show(num_layers)}."
                )
            self.num_layers = len(block_fns)
            self._lifted = tuple(
                Lifted(fn, self, f"block_{i}") for i, fn in enumerate(block_fns)
            )
        self._stacked = callable(block_fn)

    def _prepare(self, x: Any, args: tuple, kwargs: dict) -> tuple[Any, Any, Any]:
        """Returns ``(rule, params, aux)`` for input (or output) ``x``."""
        check_input(self.module_name, x, min_rank=1, expected="[batch, ...]")
        _check_static(self.module_name, (args, kwargs))
        pairs = [fn.params_and_state(x, *args, **kwargs) for fn in self._lifted]
        params, states = (tuple(p) for p in zip(*pairs, strict=True))
        key = hk.maybe_next_rng_key()
        keys = (None,) * self.num_layers
        if key is not None:
            keys = jax.random.split(key, self.num_layers)

        def block_rule(fn):
            apply = fn.apply
            return BlockRule(
                lambda p, s, k, h: apply(p, s, k, h, *args, **kwargs), self.module_name
            )

        if self._stacked:
            keys = None if key is None else keys
            return ScanRule(block_rule(self._lifted[0])), params[0], (states[0], keys)
        return ChainRule(tuple(map(block_rule, self._lifted))), params, (states, keys)

    def __call__(self, x: jax.Array, *args: Any, **kwargs: Any) -> jax.Array:
        """Applies the blocks to ``x``; extra arguments go to ``block_fn``."""
        rule, params, aux = self._prepare(x, args, kwargs)
        if _tape.is_recording():
            return _tape.emit(rule, params, aux, x)
        if self.reversible and not hk.running_init():
            y, new_state = reversible_apply(rule, params, aux, x)
        else:
            y, new_state = rule.forward(params, aux, x)
        new_states = new_state if not self._stacked else (new_state,)
        for fn, state in zip(self._lifted, new_states, strict=True):
            fn.update_state(state)
        return y

    def inverse(self, y: jax.Array, *args: Any, **kwargs: Any) -> jax.Array:
        """Rebuilds the input from the output ``y``.

        Use the same RNG key and arguments as the forward call to replay dropout.

        Args:
          y: Output of this sequence.
          *args: Static extra arguments for ``block_fn``, as in the call.
          **kwargs: Static extra keyword arguments for ``block_fn``.

        Returns:
          The input ``x`` with ``self(x) == y`` (up to rounding). State is read,
          not updated.

        Raises:
          TypeError: If ``y`` is not floating point or an extra argument is an
            array.
        """
        rule, params, aux = self._prepare(y, args, kwargs)
        return rule.inverse(params, aux, y)
