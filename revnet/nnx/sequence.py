"""A reversible stack of a user's own NNX blocks: NNX's scan over layers.

The blocks are created as NNX's own scan-over-layers pattern creates them:
``nnx.split_rngs`` + ``nnx.vmap`` around the block's constructor, so that every
variable (parameters, BatchNorm statistics, the RNG streams that dropout
draws from) gets a leading layer axis. A call splits the stacked module into
``(graphdef, params, state)``, lifts one layer into a pure function (see
``_lift.py``) and hands both to the framework-free stack
(:func:`revnet._stack.run_stack`), which runs them in one scan inside one
:func:`revnet.invertible` function. The new state (statistics, advanced RNG
counters) comes out of the forward pass and is written back into the module
once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

import revnet
from revnet._block_checks import check_input, check_stack_options, stack_options
from revnet._checks import check_callable, check_int
from revnet._stack import invert_stack, run_stack
from revnet.nnx import _lift

_NAME = "ReversibleSequence"


def check_rngs(where: str, rngs: Any) -> nnx.Rngs:
    """Checks that ``rngs`` is an ``nnx.Rngs``."""
    if not isinstance(rngs, nnx.Rngs):
        raise TypeError(
            f"{where}: rngs must be an nnx.Rngs, such as nnx.Rngs(0), got "
            f"{type(rngs).__name__}."
        )
    return rngs


class ReversibleSequence(nnx.Module):
    """``num_layers`` copies of a block whose backward pass stores no activations.

    ``block(rngs=rngs)`` creates one shape-preserving block: a user's own
    ``nnx.Module`` (an additive coupling written by hand, or one of
    :class:`AdditiveCoupling`, :class:`AffineCoupling`,
    :class:`ReversibleTransformerBlock`), whose residual functions may hold
    ``nnx.BatchNorm``, ``nnx.LayerNorm`` and ``nnx.Dropout``. The layers'
    variables are stacked on a leading axis and run in one scan.

    Example:

    >>> class Block(nnx.Module):
    ...   def __init__(self, *, rngs):
    ...     self.f = nnx.Linear(4, 4, rngs=rngs)
    ...     self.g = nnx.Linear(4, 4, rngs=rngs)
    ...   def __call__(self, x):
    ...     x1, x2 = jnp.split(x, 2, axis=-1)
    ...     y1 = x1 + jnp.tanh(self.f(x2))
    ...     return jnp.concatenate([y1, x2 + jnp.tanh(self.g(y1))], axis=-1)
    >>> model = ReversibleSequence(Block, num_layers=8, rngs=nnx.Rngs(0))
    >>> x = jnp.ones([2, 8])
    >>> grads = nnx.grad(lambda m: m(x).sum())(model)
    >>> grads["layers"]["f"]["kernel"].shape
    (8, 4, 4)

    In reversible mode the backward pass rebuilds each layer's input from its
    output, so activation memory does not grow with depth. Differentiate in
    reverse mode only (``nnx.grad``, ``jax.vjp``): forward mode (``jax.jvp``)
    is not available for a function with a custom VJP.
    """

    def __init__(
        self,
        block: Callable[..., nnx.Module],
        num_layers: int,
        *,
        rngs: nnx.Rngs,
        reversible: bool = True,
        anchor_every: int | None = None,
        drift: revnet.DriftMonitor | None = None,
        decisions: str = "store",
        kinks: str = "recompute",
    ):
        """Creates ``num_layers`` blocks with their variables stacked.

        Args:
          block: Called as ``block(rngs=rngs)`` to create one block: an
            ``nnx.Module`` class whose only required argument is ``rngs``,
            ``functools.partial(MyBlock, 16)``, or ``lambda rngs:
            MyBlock(16, rngs=rngs)``. The block maps an array to an array of
            the same shape and dtype, and is invertible equation by equation.
          num_layers: Number of blocks.
          rngs: The RNG streams the blocks are initialised from (split into
            one per layer, as ``nnx.split_rngs`` does); blocks that hold
            streams for dropout get one each.
          reversible: If False, the very same variables run in a plain scan
            under ordinary autodiff (the honest baseline).
          anchor_every: None, or ``k``: the forward pass stores the stream
            before every ``k``-th layer, so that the backward pass's
            reconstruction error accumulates over at most ``k`` layers.
          drift: None, or a :class:`revnet.DriftMonitor` that each backward
            pass sends the reconstruction error at the anchors to.
          decisions: ``"store"`` (default) or ``"recompute"``, as in
            :func:`revnet.invertible`.
          kinks: ``"recompute"`` (default) or ``"store"``, as in
            :func:`revnet.invertible`.

        Raises:
          TypeError: If ``block`` is not callable or does not create an
            ``nnx.Module``, ``num_layers`` or ``anchor_every`` is not an
            integer, ``rngs`` not an ``nnx.Rngs``, ``reversible`` not a bool,
            ``drift`` not a ``revnet.DriftMonitor``, or a variable is a hijax
            variable.
          ValueError: If ``num_layers`` or ``anchor_every`` is not positive, or
            ``decisions`` or ``kinks`` is not one of its choices.
        """
        check_callable(_NAME, "block", block)
        if isinstance(block, nnx.Module):
            raise TypeError(
                f"{_NAME}: block must create a block, got an instance of "
                f"{type(block).__name__}; pass its class or a function, such as "
                f"lambda rngs: {type(block).__name__}(..., rngs=rngs)."
            )
        num_layers = check_int(_NAME, "num_layers", num_layers)
        check_rngs(_NAME, rngs)
        _lift.check_defaults(_NAME)
        options = check_stack_options(
            _NAME,
            reversible=reversible,
            anchor_every=anchor_every,
            drift=drift,
            decisions=decisions,
            kinks=kinks,
        )
        for option, value in options.items():
            setattr(self, option, value)
        self.num_layers = num_layers

        @nnx.split_rngs(splits=num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            layer = block(rngs=rngs)
            if not isinstance(layer, nnx.Module):
                raise TypeError(
                    f"{_NAME}: block(rngs=rngs) must create an nnx.Module, got "
                    f"{type(layer).__name__}."
                )
            return layer

        self.layers = create(rngs)
        _lift.check_vars(_NAME, self.layers)

    def _per_layer(self) -> tuple[Callable[..., Any], tuple[Any, Any, None]]:
        graphdef, params, state = _lift.split(_NAME, self.layers)
        return _lift.layer(_lift.pure(graphdef)), (params, state, None)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Applies the blocks to ``x`` and updates their state once."""
        check_input(_NAME, x, min_rank=1, expected="[batch, ...]")
        layer, per_layer = self._per_layer()
        y, new_state = run_stack(
            layer,
            per_layer,
            x,
            **stack_options(self),
            name=_NAME,
        )
        nnx.update(self.layers, new_state)
        return y

    def inverse(self, y: jax.Array) -> jax.Array:
        """Rebuilds the input from the output ``y``.

        The blocks run with their current state, which is read and not
        updated. A training-mode call advances the dropout streams' counters,
        so to replay the masks of a call, invert with the state from before it
        (``nnx.clone`` the model before the call), or call in eval mode.

        Args:
          y: Output of this sequence.

        Returns:
          The input ``x`` with ``self(x) == y`` (up to rounding).

        Raises:
          TypeError: If ``y`` is not a floating point array.
          revnet.NotInvertibleError: If a block cannot be run backwards.
        """
        check_input(_NAME, y, min_rank=1, expected="[batch, ...]")
        layer, per_layer = self._per_layer()
        return invert_stack(layer, per_layer, y, name=_NAME)
