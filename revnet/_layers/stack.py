"""The framework-free reversible stack under every front door.

A front door (Haiku's :class:`~revnet.blocks.ReversibleSequence`,
``revnet.eqx``, ``revnet.nnx``) reduces one block of its framework to a pure
*layer function*::

    layer(params_i, state_i, key_i, h) -> (y, new_state_i)

and stacks the parameters, the state and one RNG key per layer on a leading
axis. :func:`run_stack` then runs the layers as the door's
:class:`~revnet._layers.options.StackOptions` say:

* reversibly, in one ``lax.scan`` inside ONE :func:`revnet.invertible`
  function: the core saves the stack's output and builds one reverse scan that
  rebuilds each layer's input while it computes the cotangents, so activation
  memory and compile time do not grow with depth;
* with anchors (``anchor_every``) or a :class:`revnet.DriftMonitor`, in a
  :func:`revnet.scan` with ``mode="invert"``;
* or, with ``reversible=False``, in a plain ``lax.scan`` under ordinary
  autodiff: the honest baseline, on the very same parameters;

each layer's input and output constrained to ``activation_sharding``.

New state (BatchNorm statistics) is a result of the forward pass only: an
``optimization_barrier`` keeps the inversion from solving the statistics'
update backwards. The per-layer keys are explicit inputs, so dropout is
replayed exactly. :func:`invert_stack` rebuilds the input from the output.

A front door may instead give a list of layer functions and a list of
per-layer ``(params, state, key)`` triples (a heterogeneous stack): they run
unrolled, one after another, in the same reversible function.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

import revnet
from revnet._forward_and_log_det import derive
from revnet._layers.activation_sharding import sharded_layer
from revnet._layers.budget import Budget, cached, plan_within, step_bytes, structure
from revnet._layers.couplings import invert
from revnet._layers.options import DEFAULTS, StackOptions
from revnet._layers.plan import CHOICES, INVERT, REMAT
from revnet.invertible import Invertible

# A front door's log-determinant is one per example, and its method takes no
# ``batch_ndim``: the refusal of a program that mixes examples says what to
# change instead.
PER_EXAMPLE = "a flow's blocks must map each example on its own"

# The refusal of a flow whose blocks' new state is computed from the stream.
STATE_READS_INPUT = (
    "{name}: forward_and_log_det needs blocks whose map depends on the input "
    "alone, but a block's new state is computed from the input (such as "
    "BatchNorm's batch statistics in training mode, which mix the examples); "
    "use ActNorm, or run it in eval mode."
)

Layer = Callable[[Any, Any, Any, jax.Array], tuple[jax.Array, Any]]
"""``layer(params, state, key, h) -> (y, new_state)``, pure."""

PerLayer = tuple[Any, Any, Any]
"""``(params, state, keys)``, stacked on a leading axis (``keys`` may be None)."""


def checked_layer(layer: Layer, name: str, reversible: bool) -> Layer:
    """``layer`` checking that it preserves its input's shape and dtype, with its
    new state behind a barrier when ``reversible``."""

    def run(params, state, key, h):
        y, new_state = layer(params, state, key, h)
        if getattr(y, "shape", None) != h.shape or y.dtype != h.dtype:
            got = f"{jax.numpy.shape(y)} {getattr(y, 'dtype', type(y).__name__)}"
            raise ValueError(
                f"{name}: each block must preserve its input's shape and dtype; "
                f"got {h.shape} {h.dtype} -> {got}."
            )
        if reversible and jax.tree.leaves(new_state):
            # New state is a result of the forward pass only. The barrier (an
            # identity that has no inverse rule) keeps the inversion from
            # solving the statistics' update backwards for batch statistics,
            # which would keep every layer's new state alive for the backward
            # pass even when the caller drops it.
            new_state = jax.lax.optimization_barrier(new_state)
        return y, new_state

    return run


def _stack_fn(
    layer: Layer | Sequence[Layer],
    per_layer: PerLayer | Sequence[PerLayer],
    options: StackOptions,
    name: str,
    length: int | None = None,
    remat: bool = False,
) -> Callable[[jax.Array], tuple[jax.Array, Any]]:
    """The function ``h -> (y, new_state)`` of the whole stack, closing over
    ``per_layer``; anchored, it is a :func:`revnet.scan` of its own. With
    ``remat``, each layer runs under ``jax.checkpoint``."""
    reversible, spec = options.reversible, options.activation_sharding
    anchored = reversible and options.anchors
    if callable(layer):
        body_layer = checked_layer(sharded_layer(layer, spec), name, reversible)

        def body(h, xs):
            return body_layer(*xs, h)

        body.__name__ = name
        if remat:
            # Inside a scan no common subexpression spans two steps, so
            # checkpoint's guard against CSE is not needed (JAX's advice).
            body = jax.checkpoint(body, prevent_cse=False)

        def stack(h):
            if anchored:
                return revnet.scan(
                    body,
                    h,
                    tuple(per_layer),
                    length=length,
                    mode="invert",
                    **dataclasses.asdict(options.storage),
                    anchor_every=options.anchor_every,
                    drift=options.drift,
                )
            # length: a block without parameters, state or keys has nothing
            # stacked to give the scan its number of layers.
            return jax.lax.scan(body, h, tuple(per_layer), length=length)

    else:
        if anchored:
            raise ValueError(
                f"{name}: anchor_every and drift need one layer function stacked "
                "on a leading axis; a list of layers is unrolled and has no anchors."
            )
        layers = [
            checked_layer(sharded_layer(fn, spec), name, reversible) for fn in layer
        ]
        if remat:
            layers = [jax.checkpoint(fn) for fn in layers]
        triples = list(per_layer)
        if len(triples) != len(layers):
            raise ValueError(
                f"{name}: give one (params, state, key) triple per layer function, "
                f"got {len(triples)} for {len(layers)} layers."
            )

        def stack(h):
            new_states = []
            for fn, (params, state, key) in zip(layers, triples):
                h, new_state = fn(params, state, key, h)
                new_states.append(new_state)
            return h, tuple(new_states)

    stack.__name__ = name
    return stack


def run_stack(
    layer: Layer | Sequence[Layer],
    per_layer: PerLayer | Sequence[PerLayer],
    h: jax.Array,
    options: StackOptions = DEFAULTS,
    *,
    name: str = "stack",
    length: int | None = None,
) -> tuple[jax.Array, Any]:
    """Runs a stack of shape-preserving layers, reversibly by default.

    Args:
      layer: The pure layer function ``layer(params_i, state_i, key_i, h) ->
        (y, new_state_i)``; or a list of layer functions, run unrolled.
      per_layer: ``(params, state, keys)`` stacked on a leading axis, one slice
        per layer (``keys`` may be None; so may ``state``). With a list of
        layer functions: a list of ``(params_i, state_i, key_i)`` triples.
      h: The stream entering the first layer.
      options: How the stack runs (:class:`StackOptions`, checked by the
        front door that made them): reversibly or not, with anchors or a
        drift monitor, its decisions and kinks, the stream's sharding.
      name: Name of the stack in error messages (the front door's module).
      length: The number of stacked layers (needed when ``per_layer`` holds
        no arrays: a block without parameters); ignored for a list.

    Returns:
      ``(y, new_state)``: the last layer's output and the layers' new state,
      stacked on a leading axis (a list, one per layer, for a list of layers).

    Raises:
      ValueError: If a layer changes the shape or dtype of the stream, or
        anchors are asked for with a list of layers.

    Example:

    >>> def layer(w, state, key, h):
    ...   h1, h2 = jnp.split(h, 2, axis=-1)
    ...   y1 = h1 + jnp.tanh(h2 @ w)
    ...   return jnp.concatenate([y1, h2 + jnp.tanh(y1 @ w)], -1), state
    >>> w = 0.1 * jnp.ones([8, 4, 4])
    >>> y, _ = run_stack(layer, (w, None, None), jnp.ones([2, 8]))
    >>> y.shape
    (2, 8)
    """
    if options.plan is not None:
        return tuple(_planned(layer, per_layer, h, options, name, length))
    return _unplanned(layer, per_layer, options, name, length)(h)


def _unplanned(layer, per_layer, options: StackOptions, name: str, length):
    """``h -> (y, new_state)`` of a stack without a plan (see :func:`run_stack`)."""
    stack = _stack_fn(layer, per_layer, options, name, length)
    return stack if options.anchors else _reversible(stack, options)


def _call(fn: Callable, h: jax.Array) -> tuple:
    return fn(h)  # one group of a plan's layers


def _planned(
    layer,
    per_layer,
    h,
    options: StackOptions,
    name: str,
    length,
    run_group: Callable = _call,
    kind: Any = None,
):
    """Runs the plan's groups of layers one after another: those that store
    (plain autodiff), those that recompute (``jax.checkpoint``), then those
    that invert (as :func:`run_stack` runs a stack without a plan).

    ``run_group(fn, h)`` runs one group's function ``fn`` (``h -> (y,
    new_state)``) and returns ``(y, new_state, *more)``: by default, calls
    it. With ``more``, each of its items is summed over the groups. ``kind``
    tells the cache of plans one ``run_group`` from another."""
    stacked = callable(layer)
    depth = _depth(per_layer, length) if stacked else len(layer)
    plan = options.plan
    if isinstance(plan, Budget):
        plan = _within(plan, layer, per_layer, h, options, name, depth, run_group, kind)
    counts = plan.counts(depth, name)
    plain = StackOptions(False, activation_sharding=options.activation_sharding)
    rest = dataclasses.replace(options, plan=None)
    start, states, totals = 0, [], None
    for choice, n in zip(CHOICES, counts):
        if n == 0:
            continue
        group_layer, group = _group(layer, per_layer, start, n)
        start += n
        if choice == INVERT:
            fn = _unplanned(group_layer, group, rest, name, n)
        else:
            fn = _stack_fn(group_layer, group, plain, name, n, remat=choice == REMAT)
        h, state, *more = run_group(fn, h)
        states.append(state)
        totals = more if totals is None else [a + b for a, b in zip(totals, more)]
    if not stacked:
        state = tuple(s for state in states for s in state)
    else:
        state = jax.tree.map(lambda *xs: jax.numpy.concatenate(xs), *states)
    return (h, state, *totals)


def _within(
    budget, layer, per_layer, h, options, name: str, depth: int, run_group, kind
):
    """The plan of the stack within ``budget`` (:mod:`revnet._layers.budget`),
    each group run by ``run_group`` (see :func:`_planned`)."""
    limit = budget.bytes(name)

    def measure(plan):
        planned = dataclasses.replace(options, plan=plan)

        def outputs(per_layer, h):
            y, _, *more = _planned(layer, per_layer, h, planned, name, depth, run_group)
            return sum((jax.numpy.sum(m) for m in more), jax.numpy.sum(y))

        return step_bytes(outputs, per_layer, h)

    key = (
        structure(layer, per_layer, h),
        depth,
        limit,
        dataclasses.replace(options, plan=None),
        kind,
    )
    return cached(key, lambda: plan_within(limit, measure, depth, name))


def _depth(per_layer: PerLayer, length: int | None) -> int:
    """The number of layers of a stacked ``per_layer``."""
    leaves = jax.tree.leaves(per_layer)
    if leaves:
        return leaves[0].shape[0]
    if length is None:
        raise ValueError("a stack without per-layer arrays needs its length")
    return length


def _group(layer, per_layer, start: int, n: int):
    """Layers ``start`` to ``start + n`` of a stack: its layer function(s)
    and their per-layer values."""
    if callable(layer):
        return layer, jax.tree.map(lambda a: a[start : start + n], per_layer)
    return layer[start : start + n], per_layer[start : start + n]


def _reversible(fn: Callable, options: StackOptions) -> Callable:
    """``fn`` as one reversible function with the options' decisions and
    kinks; as it is with ``reversible=False``."""
    if not options.reversible:
        return fn
    return Invertible(fn, options.storage)


def run_stack_with_log_det(
    layer: Layer | Sequence[Layer],
    per_layer: PerLayer | Sequence[PerLayer],
    h: jax.Array,
    options: StackOptions = DEFAULTS,
    *,
    name: str = "stack",
    batch_ndim: int = 1,
    length: int | None = None,
) -> tuple[jax.Array, jax.Array, Any]:
    """Runs a stack of flow steps: ``(y, log_det, new_state)``, one
    log-determinant per example (the leading axis of ``h``), derived from the
    program; with ``batch_ndim=0``, ``h`` is one example and ``log_det`` a
    scalar.

    The layers' new state is no part of the map, so the program must compute
    it without the stream: state passed through unchanged (BatchNorm's in
    eval mode) or advanced on its own (an RNG stream's counter) is returned
    as :func:`run_stack` returns it, and the log-determinant is that of the
    map with the given state and keys; state computed from the stream
    (BatchNorm's batch statistics in training mode) is refused.

    Reversibly (the default) the log-determinant is one more output of the
    stack's reversible call, so its gradient, like the output's, costs
    activation memory that does not grow with depth; with ``reversible=False``
    the same terms run under ordinary autodiff.

    Args:
      layer: As for :func:`run_stack`.
      per_layer: As for :func:`run_stack`.
      h: The stream entering the first layer, ``[batch, ...]``.
      options: As for :func:`run_stack`; anchors and a drift monitor are not
        supported here.
      name: Name of the stack in error messages.
      batch_ndim: 1, or 0 for one example.
      length: As for :func:`run_stack`.

    Returns:
      ``(y, log_det, new_state)``, ``log_det`` of shape ``[batch]`` (a scalar
      for one example), ``new_state`` as :func:`run_stack`'s.

    Raises:
      ValueError: If anchors or a drift monitor are asked for, or a layer's
        new state is computed from the stream (a flow's map must be a
        function of its input alone).
      revnet.NotInvertibleError: If a layer cannot be inverted or its
        log-determinant cannot be derived.

    Example:

    >>> def layer(w, state, key, h):
    ...   h1, h2 = jnp.split(h, 2, axis=-1)
    ...   return jnp.concatenate([h1, h2 * jnp.exp(jnp.tanh(h1 @ w))], -1), state
    >>> w = 0.1 * jnp.ones([8, 2, 2])
    >>> h = jnp.ones([3, 4])
    >>> y, log_det, _ = run_stack_with_log_det(layer, (w, None, None), h)
    >>> log_det.shape
    (3,)
    """
    if options.anchors:
        raise ValueError(
            f"{name}: forward_and_log_det runs the stack in one reversible call; "
            "it takes no anchor_every or drift (build the flow without them)."
        )
    refusal = STATE_READS_INPUT.format(name=name)

    def with_log_det(fn, h):
        (y, new_state), log_det = derive(
            fn, (h,), (), batch_ndim, PER_EXAMPLE, aux=refusal
        )
        return y, new_state, log_det

    if options.plan is not None:
        kind = ("log_det", batch_ndim)
        y, new_state, log_det = _planned(
            layer, per_layer, h, options, name, length, with_log_det, kind
        )
        return y, log_det, new_state
    fn = _unplanned(layer, per_layer, options, name, length)
    y, new_state, log_det = with_log_det(fn, h)
    return y, log_det, new_state


def invert_stack(
    layer: Layer | Sequence[Layer],
    per_layer: PerLayer | Sequence[PerLayer],
    y: jax.Array,
    options: StackOptions = DEFAULTS,
    *,
    name: str = "stack",
    length: int | None = None,
) -> jax.Array:
    """Rebuilds the input of :func:`run_stack` from its output ``y``.

    Args:
      layer: The layer function (or list of them) given to :func:`run_stack`.
      per_layer: The same per-layer parameters, state and keys (the same keys
        replay dropout).
      y: The stack's output.
      options: The options given to :func:`run_stack`; only the stream's
        sharding matters here (the inverse stores and decides nothing).
      name: Name of the stack in error messages.
      length: As for :func:`run_stack`.

    Returns:
      The input ``h`` with ``run_stack(layer, per_layer, h)[0] == y`` (up to
      rounding). State is read, not updated.

    Raises:
      revnet.NotInvertibleError: If a layer cannot be run backwards.

    Example:

    >>> def layer(w, state, key, h):
    ...   return h + jnp.tanh(w) * jnp.ones_like(h), state
    >>> w = jnp.ones([3])
    >>> y, _ = run_stack(layer, (w, None, None), jnp.zeros([2]))
    >>> x = invert_stack(layer, (w, None, None), y)
    >>> bool(jnp.allclose(x, 0.0, atol=1e-6))
    True
    """
    plain = StackOptions(activation_sharding=options.activation_sharding)
    stack = _stack_fn(layer, per_layer, plain, name, length)

    def outputs(h):
        return stack(h)[0]

    outputs.__name__ = name
    return invert(outputs, y)
