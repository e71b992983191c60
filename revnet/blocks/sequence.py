"""ReversibleSequence: a stack of invertible blocks with O(1) activation memory.

A block is any Haiku function whose computation the core can run backwards
equation by equation: plain ``jnp`` code and ordinary Haiku modules
(``hk.Linear``, ``hk.nets.MLP``, ``hk.Conv2D``, ``hk.BatchNorm``,
``hk.dropout``) inside residual functions, or revnet's couplings.

The block's ``init``/``apply`` are lifted out of Haiku (``_lift.py``): one
independently initialised copy of its parameters and state per layer, stacked
on a leading axis as ``hk.layer_stack`` does. The framework-free stack
(``revnet/_layers/stack.py``, shared with the other front doors) then runs the layers
in a ``lax.scan`` over that axis inside ONE :func:`revnet.invertible` function,
which closes over the parameters, the state and one RNG key per layer. The core saves
only the stack's outputs and builds one reverse scan for the backward pass that
rebuilds each layer's input from its output while it computes the cotangents,
so activation memory and compile time do not grow with depth. New state
(BatchNorm statistics) is an output of the forward pass only; the per-layer
keys are explicit, so dropout is replayed exactly.

With ``reversible=False`` the very same parameters run through the very same
forward scan under ordinary autodiff: the honest baseline.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import haiku as hk
import jax
import numpy as np

import revnet
from revnet._layers.activation_sharding import constrain
from revnet._layers.checks import check_blocks, check_input
from revnet._layers.options import OptionViews, StackOptions
from revnet._layers.precision import ComputeDtype
from revnet._layers.stack import invert_stack, run_stack, run_stack_with_log_det
from revnet.blocks._lift import Lifted, PureApply
from revnet.blocks._names import check_name

BlockFn = Callable[..., jax.Array]


def _check_static(module: str, args: Any) -> None:
    for leaf in jax.tree.leaves(args):
        if isinstance(leaf, (jax.Array, np.ndarray)):
            raise TypeError(
                f"{module}: extra arguments to the block function must be static "
                f"Python values (such as is_training), got an array {leaf.shape}."
            )


def _with_args(apply: PureApply, args: tuple, kwargs: dict) -> PureApply:
    """``apply`` with the block's static extra arguments."""

    def layer(params, state, key, h):
        return apply(params, state, key, h, *args, **kwargs)

    return layer


class ReversibleSequence(OptionViews, hk.Module):
    """A stack of invertible blocks whose backward pass stores no activations.

    ``block_fn(x, *args, **kwargs) -> y`` builds and applies one shape-preserving
    block (as with ``hk.layer_stack``); ``num_layers`` copies of it run in a scan
    over parameters stacked on a leading axis. The block may be any Haiku code
    that is invertible equation by equation, such as an additive coupling
    written by hand:

    >>> def block(h):
    ...   h1, h2 = jnp.split(h, 2, axis=-1)
    ...   y1 = h1 + hk.nets.MLP([16, h2.shape[-1]])(h2)
    ...   y2 = h2 + jnp.tanh(hk.Linear(h1.shape[-1])(y1))
    ...   return jnp.concatenate([y1, y2], axis=-1)
    >>> model = hk.transform(lambda x: ReversibleSequence(block, num_layers=8)(x))
    >>> x = jnp.ones([2, 8])
    >>> params = model.init(jax.random.PRNGKey(0), x)
    >>> jax.grad(lambda p: model.apply(p, None, x).sum())(params) is not None
    True

    In reversible mode the backward pass rebuilds each block's input from its
    output, so activation memory does not grow with depth. Differentiate it in
    reverse mode only (``jax.grad``, ``jax.vjp``): forward mode (``jax.jvp``,
    ``jax.jacfwd``) is not available for a function with a custom VJP.
    """

    def __init__(
        self,
        block_fn: BlockFn | Sequence[BlockFn],
        num_layers: int | None = None,
        reversible: bool = True,
        anchor_every: int | None = None,
        drift: revnet.DriftMonitor | None = None,
        name: str | None = None,
        *,
        decisions: str = "store",
        kinks: str = "recompute",
        activation_sharding: Any = None,
        compute_dtype: Any = None,
        plan: Any = None,
    ):
        """Constructs the sequence.

        Args:
          block_fn: Function building and applying one block, or a list of such
            functions for a heterogeneous stack (run one after another; activation
            memory stays constant in depth, compile time grows with the list).
          num_layers: Number of copies of ``block_fn``; leave out with a list.
          reversible: If False, run the same parameters with ordinary backprop.
          anchor_every: None, or a positive integer ``k``: the forward pass
            stores the stream before every ``k``-th layer (``ceil(num_layers /
            k)`` activations) and the backward pass, which rebuilds the others
            by inversion, restarts from each stored one, so reconstruction
            error accumulates over at most ``k`` layers. FLOPs are those of
            the reversible pass; ``anchor_every=1`` holds one activation per
            layer, as backprop does. Needs a single ``block_fn``.
          drift: None, or a :class:`revnet.DriftMonitor` that each backward
            pass sends the reconstruction error at every anchor to (without
            ``anchor_every``, the input is stored and the error of the whole
            stack is reported). See :mod:`revnet.drift`.
          name: Name of the module.
          decisions: ``"store"`` (default): results of the blocks that jump
            (comparisons, ``argmax``/``top_k`` routing, ``sign``, ``round``)
            are stored by the forward pass, one decision tensor per layer, and
            not made again on rebuilt values; ``"recompute"`` stores nothing
            and may follow another branch near a tie. See
            :func:`revnet.invertible`.
          kinks: ``"recompute"`` (default) or ``"store"``: also store the
            branch of ``max``/``min``/``abs``/``relu`` on rebuilt values.
          activation_sharding: None, or the ``jax.sharding.PartitionSpec`` (on
            the mesh set by ``jax.set_mesh``) or ``NamedSharding`` of the
            residual stream, such as ``P("data")``: each layer's input and
            output are constrained to it (``with_sharding_constraint`` under
            Auto mesh axes). Under Explicit axes each layer runs with the
            mesh's axes Auto inside (``jax.sharding.auto_axes``), so that
            Haiku modules may hold tensor-parallel parameters, and its output
            is resharded to it. See :mod:`revnet.blocks.sharding`.
          plan: None, a :class:`revnet.StackPlan` (how many layers store
            their residuals, as plain backprop, or recompute from their input,
            as ``jax.checkpoint``, instead of inverting: the fastest choice
            where memory is to spare), or a :class:`revnet.Budget` in which
            the plan is found by compiling. Needs ``reversible=True``.
          compute_dtype: None, or a floating point dtype (e.g.
            ``jnp.bfloat16``) in which the residual functions of the couplings
            in the block (``AdditiveCoupling``, ``AffineCoupling``, and those of
            ``RevNet``'s and ``ReversibleTransformer``'s blocks) compute, unless
            a coupling sets its own; parameters and the residual stream keep
            their dtype, so inversion keeps the stream's accuracy. A block that
            builds no coupling is refused (cast inside its own residual
            functions instead).

        Raises:
          TypeError: If ``block_fn`` is neither a callable nor a list of
            callables, ``num_layers`` or ``anchor_every`` is not an integer (a
            bool or a float), ``reversible`` is not a bool, or ``drift`` is
            not a ``revnet.DriftMonitor``, or ``compute_dtype`` is not None or a
            floating point dtype.
          ValueError: If ``num_layers`` is missing, not positive, or given with a
            list of block functions; if ``anchor_every`` is not positive, or
            given (or ``drift``) with a list of block functions.
        """
        check_name(type(self), name)
        super().__init__(name=name)
        options = StackOptions.checked(
            self.module_name,
            reversible=reversible,
            anchor_every=anchor_every,
            drift=drift,
            decisions=decisions,
            kinks=kinks,
            activation_sharding=activation_sharding,
            plan=plan,
        )
        _build(self, block_fn, num_layers, options, compute_dtype)

    def _layers(self, x: Any, args: tuple, kwargs: dict) -> tuple[Any, Any]:
        """The layer function(s) and per-layer parameters, state and keys of
        :func:`revnet._layers.stack.run_stack`, fetched (or created, at init) here."""
        module = self.module_name
        check_input(module, x, min_rank=1, expected="[batch, ...]")
        _check_static(module, (args, kwargs))
        if self._stacked or not hk.running_init():
            pairs = [fn.params_and_state(x, *args, **kwargs) for fn in self._lifted]
        else:
            # Each block of a list is initialised from its own input.
            pairs, h = [], x
            for fn in self._lifted:
                params, state, h = fn.initialised(h, *args, **kwargs)
                pairs.append((params, state))
        key = hk.maybe_next_rng_key()
        keys = None if key is None else jax.random.split(key, self.num_layers)
        layers = [_with_args(fn.apply, args, kwargs) for fn in self._lifted]
        if self._stacked:
            ((params, state),) = pairs
            return layers[0], (params, state, keys)
        layer_keys = [None] * self.num_layers if keys is None else list(keys)
        triples = [(p, s, k) for (p, s), k in zip(pairs, layer_keys)]
        return layers, triples

    def __call__(self, x: jax.Array, *args: Any, **kwargs: Any) -> jax.Array:
        """Applies the blocks to ``x``; extra arguments go to ``block_fn``."""
        # The stream enters with its sharding, so that the layers' constraints
        # do not change its type inside the reversible function.
        x = constrain(x, self.activation_sharding)
        layer, per_layer = self._layers(x, args, kwargs)
        options = self.options
        if hk.running_init():
            # Initialisation needs the values only, which every plan gives:
            # a budget is planned for the step that trains.
            options = dataclasses.replace(options, plan=None)
        y, new_states = run_stack(
            layer,
            per_layer,
            x,
            options,
            name=self.module_name,
            length=self.num_layers,
        )
        _write_state(self, new_states)
        return y

    def forward_and_log_det(
        self, x: jax.Array, *args: Any, **kwargs: Any
    ) -> tuple[jax.Array, jax.Array]:
        """Applies the blocks; returns ``(y, log_det)``, ``log_det`` of shape
        ``[batch]`` derived from the blocks' program.

        The log-determinant is one more output of the reversible stack, so
        training a flow on ``log_prob(y) + log_det`` keeps activation memory
        flat in depth (with ``reversible=False``: ordinary autodiff).

        The blocks' new state is written back as by a call: state the blocks
        do not compute from ``x`` (``hk.BatchNorm``'s with
        ``is_training=False``) is fine, and dropout draws its keys from the
        ``rng`` of ``apply`` as a call does.

        Args:
          x: Input of shape ``[batch, ...]``.
          *args: Static extra arguments for ``block_fn``.
          **kwargs: Static extra keyword arguments for ``block_fn``.

        Returns:
          ``(y, log_det)``.

        Raises:
          ValueError: If the sequence has anchors or a drift monitor, or a
            block's new state is computed from ``x`` (BatchNorm's batch
            statistics with ``is_training=True``).
          revnet.NotInvertibleError: If a block cannot be inverted or its
            log-determinant cannot be derived (the message names the step).
        """
        x = constrain(x, self.activation_sharding)
        layer, per_layer = self._layers(x, args, kwargs)
        y, log_det, new_states = run_stack_with_log_det(
            layer,
            per_layer,
            x,
            self.options,
            name=self.module_name,
            length=self.num_layers,
        )
        _write_state(self, new_states)
        return y, log_det

    def inverse(self, y: jax.Array, *args: Any, **kwargs: Any) -> jax.Array:
        """Rebuilds the input from the output ``y``.

        Use the same RNG key and arguments as the forward call to replay
        dropout: with dropout, call ``inverse`` in a separate ``apply`` with
        the same ``rng`` as the forward call's (inside the same ``apply`` the
        rng sequence has advanced, so the masks differ).

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
          revnet.NotInvertibleError: If a block cannot be run backwards.
        """
        y = constrain(y, self.activation_sharding)
        layer, per_layer = self._layers(y, args, kwargs)
        x = invert_stack(
            layer,
            per_layer,
            y,
            self.options,
            name=self.module_name,
            length=self.num_layers,
        )
        self._compute.check_used(self.module_name)
        return x


class Stage(ReversibleSequence):
    """A :class:`ReversibleSequence` built by a model from options the model
    checked: ``RevNet``'s stages, ``ReversibleTransformer``'s layers.

    Args:
      block_fn: Function building and applying one block.
      num_layers: Number of copies of ``block_fn``.
      options: The model's options, checked once, by the model.
      name: Name of the module.
    """

    def __init__(
        self, block_fn: BlockFn, num_layers: int, options: StackOptions, name: str
    ):
        hk.Module.__init__(self, name=name)
        _build(self, block_fn, num_layers, options, None)


def _write_state(seq: ReversibleSequence, new_states: Any) -> None:
    """Checks that the compute dtype was used and writes the blocks' new
    state (from the stack) into the enclosing transform. A function, not a
    method, like :func:`_build`: Haiku scopes what a module's methods do
    under the methods' names."""
    seq._compute.check_used(seq.module_name)
    if seq._stacked:
        new_states = (new_states,)
    for fn, state in zip(seq._lifted, new_states, strict=True):
        fn.update_state(state)


def _build(
    seq: ReversibleSequence,
    block_fn: BlockFn | Sequence[BlockFn],
    num_layers: Any,
    options: StackOptions,
    compute_dtype: Any,
) -> None:
    """Sets up a sequence with its options: checks its blocks and compute
    dtype, and lifts the blocks. A function, not a method: Haiku names the
    modules a method creates after the method, and the lifted blocks belong
    to the constructor."""
    module = seq.module_name
    seq.options = options
    seq._compute = ComputeDtype.checked(module, compute_dtype)
    seq.compute_dtype = seq._compute.dtype
    block_fns, seq.num_layers, seq._stacked = check_blocks(
        module, "block_fn", block_fn, num_layers, anchored=options.anchors
    )
    if seq._stacked:
        seq._lifted = (
            Lifted(
                seq._compute.scoped(block_fn),
                seq,
                "layers",
                num_stacked=seq.num_layers,
            ),
        )
    else:
        seq._lifted = tuple(
            Lifted(seq._compute.scoped(fn), seq, f"block_{i}")
            for i, fn in enumerate(block_fns)
        )
    # The block functions as given (one entry for ``num_layers`` copies),
    # for running the same blocks another way, such as a plain-Haiku loop.
    seq.block_fns = block_fns
