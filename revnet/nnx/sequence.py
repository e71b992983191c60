"""A reversible stack of a user's own NNX blocks: NNX's scan over layers.

The blocks are created as NNX's own scan-over-layers pattern creates them:
``nnx.split_rngs`` + ``nnx.vmap`` around the block's constructor, so that every
variable (parameters, BatchNorm statistics, the RNG streams that dropout
draws from) gets a leading layer axis. A call splits the stacked module into
``(graphdef, params, state)``, lifts one layer into a pure function (see
``_lift.py``) and hands both to the framework-free stack
(:func:`revnet._layers.stack.run_stack`), which runs them in one scan inside one
:func:`revnet.invertible` function. The new state (statistics, advanced RNG
counters) comes out of the forward pass and is written back into the module
once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

import revnet
from revnet._layers import data_init
from revnet._layers.activation_sharding import constrain
from revnet._layers.checks import check_blocks, check_input
from revnet._layers.options import OptionViews, StackOptions
from revnet._layers.precision import ComputeDtype
from revnet._layers.stack import invert_stack, run_stack, run_stack_with_log_det
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


def _check_factory(block: Any, where: str) -> None:
    """Refuses a module instance where a factory of blocks is expected."""
    if isinstance(block, nnx.Module):
        raise TypeError(
            f"{_NAME}: {where} must create a block, got an instance of "
            f"{type(block).__name__}; pass its class or a function, such as "
            f"lambda rngs: {type(block).__name__}(..., rngs=rngs)."
        )


def _created(block: Callable[..., Any], rngs: nnx.Rngs) -> nnx.Module:
    """``block(rngs=rngs)``, checked to be an ``nnx.Module``."""
    layer = block(rngs=rngs)
    if not isinstance(layer, nnx.Module):
        raise TypeError(
            f"{_NAME}: block(rngs=rngs) must create an nnx.Module, got "
            f"{type(layer).__name__}."
        )
    return layer


class ReversibleSequence(OptionViews, nnx.Module):
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
        block: Callable[..., nnx.Module] | Sequence[Callable[..., nnx.Module]],
        num_layers: int | None = None,
        *,
        rngs: nnx.Rngs,
        reversible: bool = True,
        anchor_every: int | None = None,
        drift: revnet.DriftMonitor | None = None,
        decisions: str = "store",
        kinks: str = "recompute",
        activation_sharding: Any = None,
        compute_dtype: Any = None,
        plan: Any = None,
    ):
        """Creates ``num_layers`` blocks with their variables stacked.

        Args:
          block: Called as ``block(rngs=rngs)`` to create one block: an
            ``nnx.Module`` class whose only required argument is ``rngs``,
            ``functools.partial(MyBlock, 16)``, or ``lambda rngs:
            MyBlock(16, rngs=rngs)``. The block maps an array to an array of
            the same shape and dtype, and is invertible equation by equation.
            Or a list of such factories for a stack of different blocks, run
            one after another (unrolled: activation memory stays constant in
            depth, compile time grows with the list).
          num_layers: Number of blocks; leave out with a list.
          rngs: The RNG streams the blocks are initialised from (split into
            one per layer, as ``nnx.split_rngs`` does; forked per block of a
            list); blocks that hold streams for dropout get one each.
          reversible: If False, the very same variables run in a plain scan
            under ordinary autodiff (the honest baseline).
          anchor_every: None, or ``k``: the forward pass stores the stream
            before every ``k``-th layer, so that the backward pass's
            reconstruction error accumulates over at most ``k`` layers.
            Needs a single ``block``.
          drift: None, or a :class:`revnet.DriftMonitor` that each backward
            pass sends the reconstruction error at the anchors to.
          decisions: ``"store"`` (default) or ``"recompute"``, as in
            :func:`revnet.invertible`.
          kinks: ``"recompute"`` (default) or ``"store"``, as in
            :func:`revnet.invertible`.
          activation_sharding: None, or the ``jax.sharding.PartitionSpec``
            (on the mesh set by ``jax.set_mesh``) or ``NamedSharding`` of the
            stream, such as ``P("data")``: each layer's input and output are
            constrained to it (under Explicit mesh axes each layer runs with
            the axes Auto inside), as in the Haiku door.
          plan: None, a :class:`revnet.StackPlan` (how many layers store
            their residuals, as plain backprop, or recompute from their input,
            as ``jax.checkpoint``, instead of inverting: the fastest choice
            where memory is to spare), or a :class:`revnet.Budget` in which
            the plan is found by compiling. Needs ``reversible=True``.
          compute_dtype: None, or a floating point dtype (e.g.
            ``jnp.bfloat16``) in which the residual functions of the
            couplings in the blocks (:class:`AdditiveCoupling`,
            :class:`AffineCoupling`, :class:`ReversibleTransformerBlock`)
            compute, unless a coupling sets its own; parameters and the
            stream keep their dtype, so inversion keeps the stream's
            accuracy. Blocks that build no coupling are refused.

        Raises:
          TypeError: If ``block`` is not callable (or a list of callables),
            is a module instance or does not create an ``nnx.Module``,
            ``num_layers`` or ``anchor_every`` is not an integer, ``rngs``
            not an ``nnx.Rngs``, ``reversible`` not a bool, ``drift`` not a
            ``revnet.DriftMonitor``, ``activation_sharding`` not a spec,
            ``compute_dtype`` not a floating point dtype, or a variable is a
            hijax variable.
          ValueError: If ``num_layers`` or ``anchor_every`` is not positive,
            ``num_layers`` is missing with one block or given with a list,
            anchors are asked of a list, ``decisions`` or ``kinks`` is not
            one of its choices, or ``compute_dtype`` is given and the blocks
            build no coupling.
        """
        blocks, self.num_layers, self._stacked = check_blocks(
            _NAME,
            "block",
            block,
            num_layers,
            anchored=anchor_every is not None or drift is not None,
        )
        for i, factory in enumerate(blocks):
            _check_factory(factory, "block" if self._stacked else f"block[{i}]")
        check_rngs(_NAME, rngs)
        _lift.check_defaults(_NAME)
        self.options = StackOptions.checked(
            _NAME,
            reversible=reversible,
            anchor_every=anchor_every,
            drift=drift,
            decisions=decisions,
            kinks=kinks,
            activation_sharding=activation_sharding,
            plan=plan,
        )
        compute = ComputeDtype.checked(_NAME, compute_dtype)
        self.compute_dtype = compute.dtype
        if self._stacked:

            @nnx.split_rngs(splits=self.num_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def create(rngs):
                return _created(compute.scoped(block), rngs)

            self.layers = create(rngs)
        else:
            self.layers = nnx.List(
                [_created(compute.scoped(b), rngs.fork()) for b in blocks]
            )
        compute.check_used(_NAME)
        _lift.check_vars(_NAME, self.layers)

    def _per_layer(self) -> tuple[Any, Any]:
        """The layer function(s) and per-layer ``(params, state, None)`` of
        :func:`revnet._layers.stack.run_stack`."""
        if self._stacked:
            graphdef, params, state = _lift.split(_NAME, self.layers)
            return _lift.layer(_lift.pure(graphdef)), (params, state, None)
        layers, per_layer = [], []
        for module in self.layers:
            graphdef, params, state = _lift.split(_NAME, module)
            layers.append(_lift.layer(_lift.pure(graphdef)))
            per_layer.append((params, state, None))
        return layers, per_layer

    def __call__(self, x: jax.Array) -> jax.Array:
        """Applies the blocks to ``x`` and updates their state once."""
        check_input(_NAME, x, min_rank=1, expected="[batch, ...]")
        x = constrain(x, self.activation_sharding)
        layer, per_layer = self._per_layer()
        y, new_state = run_stack(
            layer, per_layer, x, self.options, name=_NAME, length=self.num_layers
        )
        self._update(new_state)
        return y

    def _update(self, new_state: Any) -> None:
        """Writes the layers' new state (from the stack) into the blocks."""
        if self._stacked:
            nnx.update(self.layers, new_state)
        else:
            for module, state in zip(self.layers, new_state, strict=True):
                nnx.update(module, state)

    def forward_and_log_det(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Applies the blocks; returns ``(y, log_det)``, ``log_det`` of shape
        ``[batch]`` derived from the blocks' program.

        The log-determinant is one more output of the reversible stack, so
        training a flow on ``log_prob(y) + log_det`` keeps activation memory
        flat in depth (with ``reversible=False``: ordinary autodiff).

        The blocks' new state is written back as by a call: state the blocks
        do not compute from ``x`` (BatchNorm's statistics in eval mode, the
        counters of the streams dropout draws from) is fine, and ``log_det``
        is that of the map with the blocks' state before the call (their
        dropout masks included).

        Args:
          x: Input of shape ``[batch, ...]``.

        Returns:
          ``(y, log_det)``.

        Raises:
          ValueError: If the sequence has anchors or a drift monitor, or a
            block's new state is computed from ``x`` (BatchNorm's batch
            statistics in training mode).
          revnet.NotInvertibleError: If a block cannot be inverted or its
            log-determinant cannot be derived (the message names the step).
        """
        check_input(_NAME, x, min_rank=1, expected="[batch, ...]")
        x = constrain(x, self.activation_sharding)
        layer, per_layer = self._per_layer()
        y, log_det, new_state = run_stack_with_log_det(
            layer, per_layer, x, self.options, name=_NAME, length=self.num_layers
        )
        self._update(new_state)
        return y, log_det

    def initialize(self, x: jax.Array) -> jax.Array:
        """Initialises the blocks' data-dependent layers (:class:`ActNorm`)
        from the batch ``x``, each block from its own input; returns the
        output.

        The blocks run one after another, not reversibly; only their
        parameters change (their other state, such as BatchNorm statistics
        and RNG counters, is left as it was).

        Args:
          x: A batch, ``[batch, ...]``.

        Returns:
          The sequence's output for ``x`` with the new parameters.
        """
        check_input(_NAME, x, min_rank=1, expected="[batch, ...]")
        modules = (self.layers,) if self._stacked else tuple(self.layers)
        h, updated = x, []
        for module in modules:
            graphdef, params, state = _lift.split(_NAME, module)
            slices = [(params, state)]
            if self._stacked:
                slices = [
                    jax.tree.map(lambda a, i=i: a[i], (params, state))
                    for i in range(self.num_layers)
                ]
            new = []
            for p, st in slices:
                block = nnx.merge(graphdef, p, st, copy=True)
                with data_init.collecting():
                    h = block(h)
                new.append(nnx.split(block, nnx.Param, ...)[1])
            updated.append(
                jax.tree.map(lambda *a: jax.numpy.stack(a), *new)
                if self._stacked
                else new[0]
            )
        for module, params in zip(modules, updated, strict=True):
            nnx.update(module, params)
        return h

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
        y = constrain(y, self.activation_sharding)
        layer, per_layer = self._per_layer()
        return invert_stack(
            layer, per_layer, y, self.options, name=_NAME, length=self.num_layers
        )
