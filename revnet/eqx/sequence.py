"""ReversibleSequence: Equinox's scan over layers, with O(1) activation memory.

As in Equinox's own recipe, ``num_layers`` copies of a block are built with
``eqx.filter_vmap`` (one module whose array leaves have a leading layer axis)
and split with ``eqx.partition`` into arrays and the rest. Each layer is the
pure function ``(params_i, state_i, key_i, h) -> (y, new_state_i)`` that
``eqx.combine``s its slice back into the block and applies it, vmapped over
the batch; revnet's framework-free stack (``revnet/_layers/stack.py``) runs the layers
in one scan inside ONE :func:`revnet.invertible` function, whose backward pass
rebuilds each layer's input from its output instead of storing it. New
``eqx.nn.State`` (BatchNorm statistics) comes from the forward pass only; one
key per layer (and per example) replays dropout exactly. With
``reversible=False`` the same blocks run in a plain ``lax.scan`` under
ordinary autodiff: the twin to compare with.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import equinox as eqx
import jax

import revnet
from revnet._checks import fail
from revnet._layers.activation_sharding import constrain
from revnet._layers.checks import check_blocks, check_input
from revnet._layers.options import OptionViews, StackOptions
from revnet._layers.precision import ComputeDtype
from revnet._layers.stack import invert_stack, run_stack, run_stack_with_log_det
from revnet.eqx._call import (
    check_takes_key,
    holds_state,
    missing_state,
    raised_by_revnet,
)
from revnet.eqx._init import initialized
from revnet.eqx._layer import layer_function

_NAME = "ReversibleSequence"


class ReversibleSequence(OptionViews, eqx.Module):
    """``num_layers`` copies of a block whose backward pass stores no activations.

    ``make_block(key)`` builds one shape-preserving block that acts on ONE
    example (as ``eqx.nn.Linear`` does), such as a
    :class:`~revnet.eqx.AdditiveCoupling` or a user's own module; called on a
    batch, the sequence vmaps each block over the leading axis under
    ``axis_name``, the name an ``eqx.nn.BatchNorm(axis_name="batch")`` inside
    reduces over. Call it as ``seq(x, key=key)``, or ``seq(x, state,
    key=key) -> (y, state)`` when its blocks hold state (build it with
    ``eqx.nn.make_with_state``). It works under ``eqx.filter_jit`` and
    ``eqx.filter_grad``; differentiate in reverse mode only.

    Equinox's per-example idiom works too: build it with ``axis_name=None``
    and ``jax.vmap`` (or ``eqx.filter_vmap``) the sequence over examples. The
    batched program then runs as one reversible call, so per-example code
    costs what the batched call costs (the weights' cotangents are summed
    inside each layer, not held per example).

    Example:

    >>> def make_block(key):
    ...     kf, kg = jax.random.split(key)
    ...     mlp = lambda k: eqx.nn.MLP(4, 4, 16, 1, activation=jnp.tanh, key=k)
    ...     return revnet.eqx.AdditiveCoupling(mlp(kf), mlp(kg))
    >>> seq = revnet.eqx.ReversibleSequence(make_block, 8, key=jax.random.key(0))
    >>> x = jnp.ones([2, 8])
    >>> grads = eqx.filter_grad(lambda s, x: s(x).sum())(seq, x)
    >>> grads.blocks.f.layers[0].weight.shape
    (8, 16, 4)
    >>> bool(jnp.allclose(seq.inverse(seq(x)), x, atol=1e-5))
    True
    """

    blocks: Any
    num_layers: int = eqx.field(static=True)
    stacked: bool = eqx.field(static=True)
    options: StackOptions = eqx.field(static=True)
    axis_name: Hashable | None = eqx.field(static=True)
    compute_dtype: Any = eqx.field(static=True)

    def __init__(
        self,
        make_block: Callable[[jax.Array], Any] | Sequence[Callable[[jax.Array], Any]],
        num_layers: int | None = None,
        *,
        key: jax.Array,
        reversible: bool = True,
        anchor_every: int | None = None,
        drift: revnet.DriftMonitor | None = None,
        axis_name: Hashable | None = "batch",
        decisions: str = "store",
        kinks: str = "recompute",
        activation_sharding: Any = None,
        compute_dtype: Any = None,
        plan: Any = None,
    ):
        """Builds ``num_layers`` blocks with ``eqx.filter_vmap(make_block)``.

        Args:
          make_block: Function of a PRNG key returning one block: an Equinox
            module called as ``block(h, key=key) -> y``, or ``block(h, state,
            key=key) -> (y, state)`` if it holds state, on one example. Or a
            list of such functions for a stack of different blocks, run one
            after another (unrolled: activation memory stays constant in
            depth, compile time grows with the list).
          num_layers: Number of blocks; leave out with a list.
          key: PRNG key; split into one key per block.
          reversible: If False, run the same blocks with ordinary backprop.
          anchor_every: None, or ``k``: the forward pass stores the stream
            before every ``k``-th layer and the backward pass restarts its
            inversion from each, so reconstruction error accumulates over at
            most ``k`` layers. Needs a single ``make_block``.
          drift: None, or a :class:`revnet.DriftMonitor` that each backward
            pass sends the reconstruction error at every anchor to.
          axis_name: Name of the batch axis the blocks are vmapped over; None
            to give each block the whole batch instead.
          decisions: ``"store"`` or ``"recompute"``, see :func:`revnet.invertible`.
          kinks: ``"recompute"`` or ``"store"``, see :func:`revnet.invertible`.
          activation_sharding: None, or the ``jax.sharding.PartitionSpec``
            (on the mesh set by ``jax.set_mesh``) or ``NamedSharding`` of the
            stream as the sequence sees it (the batch, or one example with
            ``axis_name=None``), such as ``P("data")``: each layer's input and
            output are constrained to it (under Explicit mesh axes each layer
            runs with the axes Auto inside), as in the Haiku door.
          plan: None, a :class:`revnet.StackPlan` (how many layers store
            their residuals, as plain backprop, or recompute from their input,
            as ``jax.checkpoint``, instead of inverting: the fastest choice
            where memory is to spare), or a :class:`revnet.Budget` in which
            the plan is found by compiling. Needs ``reversible=True``.
          compute_dtype: None, or a floating point dtype (e.g.
            ``jnp.bfloat16``) in which the residual functions of the
            couplings in the blocks (:class:`AdditiveCoupling`,
            :class:`AffineCoupling`, :class:`ReversibleTransformerBlock`)
            compute, unless a coupling sets its own; arrays and the stream
            keep their dtype, so inversion keeps the stream's accuracy.
            Blocks that build no coupling are refused.

        Raises:
          TypeError: If ``make_block`` is not callable (or a list of
            callables) or is a module instance, ``num_layers`` or
            ``anchor_every`` is not an integer, ``reversible`` not a bool,
            ``drift`` not a ``revnet.DriftMonitor``, ``key`` not a PRNG key,
            ``activation_sharding`` not a spec, ``compute_dtype`` not a
            floating point dtype, or a block takes no ``key=``.
          ValueError: If ``num_layers`` or ``anchor_every`` is not positive,
            ``num_layers`` is missing with one block or given with a list,
            anchors are asked of a list, ``decisions`` or ``kinks`` is
            unknown, or ``compute_dtype`` is given and the blocks build no
            coupling.
        """
        makers, self.num_layers, self.stacked = check_blocks(
            _NAME,
            "make_block",
            make_block,
            num_layers,
            anchored=anchor_every is not None or drift is not None,
        )
        for i, maker in enumerate(makers):
            if isinstance(maker, eqx.Module):
                where = "make_block" if self.stacked else f"make_block[{i}]"
                raise TypeError(
                    f"{_NAME}: {where} must build a block from a PRNG key, got an "
                    f"instance of {type(maker).__name__}; pass a function, such "
                    f"as lambda key: {type(maker).__name__}(..., key=key)."
                )
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
        self.axis_name = axis_name
        compute = ComputeDtype.checked(_NAME, compute_dtype)
        self.compute_dtype = compute.dtype
        typed = isinstance(key, jax.Array) and jax.dtypes.issubdtype(
            key.dtype, jax.dtypes.prng_key
        )
        raw = isinstance(key, jax.Array) and key.dtype == "uint32" and key.shape == (2,)
        if not (typed or raw):
            raise fail(_NAME, "key", key, "a PRNG key such as jax.random.key(0)")
        keys = jax.random.split(key, self.num_layers)
        if self.stacked:
            self.blocks = eqx.filter_vmap(compute.scoped(make_block))(keys)
            blocks = (self.blocks,)
        else:
            self.blocks = tuple(compute.scoped(m)(k) for m, k in zip(makers, keys))
            blocks = self.blocks
        compute.check_used(_NAME)
        for block in blocks:
            check_takes_key(block, _NAME)

    def _per_layer(self, x, state, key, where, *, per_example=False):
        """The layer function(s) and per-layer ``(params, state, keys)``;
        with ``per_example``, layers that take one example (not vmapped)."""
        ndim = 1 if self.axis_name is None else 2
        shape = "[...]"
        if self.axis_name is not None:
            shape = "[batch, ...] (for ONE example, axis_name=None and jax.vmap)"
        check_input(f"{_NAME}.{where}", x, min_rank=ndim, expected=shape)
        if state is None and holds_state(self.blocks):
            raise missing_state(_NAME, "the block", where)
        keys = None if key is None else jax.random.split(key, self.num_layers)
        blocks = (self.blocks,) if self.stacked else self.blocks
        layers, per_layer = [], []
        for i, block in enumerate(blocks):
            params, static = eqx.partition(block, eqx.is_array)
            substate = None if state is None else state.substate(block)
            layers.append(
                layer_function(static, None if per_example else self.axis_name)
            )
            layer_keys = keys if keys is None or self.stacked else keys[i]
            per_layer.append((params, substate, layer_keys))
        if self.stacked:
            return layers[0], per_layer[0]
        return layers, per_layer

    def __call__(
        self,
        x: jax.Array,
        state: eqx.nn.State | None = None,
        *,
        key: jax.Array | None = None,
    ) -> jax.Array | tuple[jax.Array, eqx.nn.State]:
        """Applies the blocks to the batch ``x``; returns ``y``, or ``(y,
        state)`` when given ``state``."""
        layer, per_layer = self._per_layer(x, state, key, "__call__")
        x = constrain(x, self.activation_sharding)
        y, new_substates = run_stack(
            layer, per_layer, x, self.options, name=_NAME, length=self.num_layers
        )
        if state is None:
            return y
        return y, self._updated(state, new_substates)

    def _updated(self, state: eqx.nn.State, new_substates: Any) -> eqx.nn.State:
        """``state`` with the blocks' new substates (from the stack).

        A clone is updated: Equinox marks a state it updated as used, and the
        state the call was given stays readable for :meth:`inverse`."""
        leaves, tree = jax.tree_util.tree_flatten(state)
        state = jax.tree_util.tree_unflatten(tree, leaves)
        for sub in (new_substates,) if self.stacked else new_substates:
            if sub is not None:
                state = state.update(sub)
        return state

    def forward_and_log_det(
        self,
        x: jax.Array,
        state: eqx.nn.State | None = None,
        *,
        key: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array] | tuple[jax.Array, jax.Array, eqx.nn.State]:
        """Applies the blocks to the batch ``x``; returns ``(y, log_det)``,
        ``log_det`` of shape ``[batch]`` derived from the blocks' program, or
        ``(y, log_det, state)`` when given ``state``, as a call returns it.

        The log-determinant is one more output of the reversible stack, so
        training a flow on ``log_prob(y) + log_det`` keeps activation memory
        flat in depth (with ``reversible=False``: ordinary autodiff).

        The blocks' new state must not be computed from ``x``: state passed
        through (``eqx.nn.BatchNorm`` under ``eqx.nn.inference_mode``) or
        advanced on its own is fine, and ``log_det`` is that of the map with
        the given state and ``key`` (dropout masks included).

        Args:
          x: The batch, ``[batch, ...]``; ONE example when the sequence was
            built with ``axis_name=None`` (``log_det`` is then a scalar).
          state: The model's state, if its blocks hold any.
          key: RNG key for the blocks.

        Returns:
          ``(y, log_det)``, or ``(y, log_det, state)`` when given ``state``.

        Raises:
          ValueError: If the sequence has anchors or a drift monitor, or a
            block's new state is computed from ``x`` (BatchNorm's batch
            statistics in training mode).
          revnet.NotInvertibleError: If a block cannot be inverted or its
            log-determinant cannot be derived (the message names the step).
        """
        where = "forward_and_log_det"
        if self.axis_name is None:
            check_input(f"{_NAME}.{where}", x, min_rank=1, expected="[...]")
            layer, per_layer = self._per_layer(x, state, key, where)
            y, log_det, new = run_stack_with_log_det(
                layer,
                per_layer,
                x,
                self.options,
                name=_NAME,
                length=self.num_layers,
                batch_ndim=0,
            )
            out = (y, log_det)
            return out if state is None else (*out, self._updated(state, new))
        # Each example's stack is its own reversible call, vmapped under the
        # batch axis: its log-determinant is that example's (a batched
        # program's own per-example proof would have to follow the batch axis
        # through the layouts vmap gives each block).
        layer, per_layer = self._per_layer(x, state, None, where, per_example=True)
        keys = None
        if key is not None:
            keys = jax.vmap(lambda k: jax.random.split(k, x.shape[0]))(
                jax.random.split(key, self.num_layers)
            )
            keys = keys.swapaxes(0, 1)  # [batch, layers]: as __call__ draws them

        def example(h, keys):
            if keys is not None:
                if self.stacked:
                    per = (per_layer[0], per_layer[1], keys)
                else:
                    per = [(p, s, k) for (p, s, _), k in zip(per_layer, keys)]
            else:
                per = per_layer
            return run_stack_with_log_det(
                layer,
                per,
                h,
                self.options,
                name=_NAME,
                length=self.num_layers,
                batch_ndim=0,
            )

        x = constrain(x, self.activation_sharding)
        # The new state, read from no example, is one for the batch (as a
        # call's, whose blocks are vmapped with out_axes None for it).
        try:
            y, log_det, new = jax.vmap(
                example, axis_name=self.axis_name, out_axes=(0, 0, None)
            )(x, keys)
        except (TypeError, ValueError) as e:
            if raised_by_revnet(e):
                raise
            # The call runs the same blocks on x, vmapped, and names what
            # failed (on a copy of the state, which a call's update retires).
            jax.eval_shape(lambda x, st: self(x, st, key=key), x, state)
            raise
        out = (y, log_det)
        return out if state is None else (*out, self._updated(state, new))

    def initialize(
        self,
        x: jax.Array,
        state: eqx.nn.State | None = None,
        *,
        key: jax.Array | None = None,
    ) -> ReversibleSequence:
        """A copy whose data-dependent layers (:class:`~revnet.eqx.ActNorm`)
        are initialised from the batch ``x``, each block from its own input.

        The blocks run one after another, not reversibly; an ActNorm takes
        its statistics over its ``axis_name``, which must be the sequence's
        (or None when the sequence's is None).

        Args:
          x: A batch, ``[batch, ...]``.
          state: The model's state, if its blocks hold any (read only).
          key: RNG key for the blocks.

        Returns:
          The initialised sequence.
        """
        per_layer = self._per_layer(x, state, key, "initialize")[1]
        return initialized(self, per_layer, x, layer_function)

    def inverse(
        self,
        y: jax.Array,
        state: eqx.nn.State | None = None,
        *,
        key: jax.Array | None = None,
    ) -> jax.Array:
        """Rebuilds the input from the output ``y``.

        Args:
          y: Output of this sequence.
          state: The state the call was given (read, not updated).
          key: The key the call was given, to replay dropout.

        Returns:
          The input ``x`` with ``self(x) == y`` (up to rounding).

        Raises:
          TypeError: If ``y`` is not a floating point array.
          revnet.NotInvertibleError: If a block cannot be run backwards.
        """
        layer, per_layer = self._per_layer(y, state, key, "inverse")
        y = constrain(y, self.activation_sharding)
        return invert_stack(
            layer, per_layer, y, self.options, name=_NAME, length=self.num_layers
        )
