"""Loops for any body: ``while_loop`` and ``scan`` with a memory-lean backward pass.

``jax.lax.while_loop`` cannot be reverse-differentiated at all, and
``jax.lax.scan`` stores every carry (and the body's activations) for the
backward pass, so its memory grows with the number of steps. revnet's loops
differentiate any body in reverse mode, and use invertibility where it exists.
The body is traced once to a jaxpr and read by the same invertibility analysis
as :func:`revnet.invertible`; with ``mode=`` (the rule in full:
:mod:`revnet._engine.loops.choose`), what it finds decides the backward pass:

* ``"invert"``, for an **invertible carry** (every leaf can be rebuilt from
  the step's outputs; :class:`revnet.NotInvertibleError` names the leaf and
  equation that prevent it): the forward pass keeps only the final carry, the
  trip count and the closed-over constants, and the backward pass walks back
  step by step, rebuilding each carry from the next by the body's inverse,
  fused with the body's VJP. Memory does not depend on the number of steps.
* ``"store"``, for a **partly invertible carry** in a loop with a bound
  (``scan``, or ``while_loop`` with ``max_steps``): the leaves that cannot be
  rebuilt are stored at every step, and only those; the others are rebuilt by
  inversion (a fully invertible body stores nothing). Example: a leapfrog
  step whose carry also holds a running maximum stores the maximum.
* ``"checkpoint"``, for any body (say, one whose inverse is ill-conditioned):
  binomial checkpointing (Griewank's ``revolve``). The forward pass keeps the
  initial carry; the backward pass recomputes carries from at most
  ``checkpoints`` snapshots, placed where they minimise the body evaluations,
  and reads the number of steps at run time. Memory: ``checkpoints`` carries.
* ``"auto"`` (the default): inverts an invertible carry; in a bounded loop in
  which inversion rebuilds at least one floating-point leaf whose update
  reads another leaf (a step counter ``i + 1`` or a clock ``t + dt`` does
  not count), stores the others; otherwise checkpoints.

``invert=`` (``True``, ``False``, ``None``) is the deprecated spelling of
``mode="invert"``, ``"checkpoint"`` and ``"auto"``, with a
``DeprecationWarning``.

In every mode the trip count is recorded by the forward pass, never recomputed
from a rebuilt carry, and the backward pass runs exactly that many steps: its
cost follows the steps taken, not ``max_steps``. Both loops are
``jax.custom_vjp`` functions: they compose with ``jit``, ``vmap`` and
``grad``; forward mode (``jax.jvp``, ``jax.jacfwd``) applied to them raises a
one-line ``TypeError``, while ``jax.hessian`` (forward-over-reverse) works.
Values the body closes over (weights, step sizes, keys) become explicit inputs
of the custom VJP, so they receive gradients also when they are tracers of an
outer transformation. Integer parts of the carry get no gradient.

Under ``vmap`` a batch whose elements stop at different steps works as with
``lax.while_loop``: the loop runs until every element has stopped and finished
elements are left unchanged (by a select), so each element records its own
trip count; in the backward pass an element whose steps are used up is left
unchanged in the same way, so it is walked back exactly its own trip count.
Under ``vmap``, ``scan`` is one scan of the batched body (the cotangents of
shared weights are summed inside each step); ``while_loop``'s backward pass is
batched per element by JAX, holding them per element until they are summed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from revnet import _loop_common as common
from revnet import _loop_options as loop_options
from revnet._engine import Body, ScanParams, scan_call, scan_function, while_function
from revnet.drift import DriftMonitor

__all__ = ["scan", "while_loop"]


def while_loop(
    cond_fun: Callable[[Any], Any],
    body_fun: Callable[[Any], Any],
    init_val: Any,
    *,
    max_steps: int | None = None,
    checkpoints: int | None = None,
    mode: str = loop_options.AUTO,
    anchor_every: int | None = None,
    drift: DriftMonitor | None = None,
    decisions: str = "store",
    kinks: str = "recompute",
    invert: Any = loop_options.UNSET,
) -> Any:
    """``lax.while_loop`` that can be reverse-differentiated, for any body.

    Runs ``val = body_fun(val)`` while ``cond_fun(val)`` is true (and, when
    ``max_steps`` is given, at most ``max_steps`` times) and returns the final
    ``val``. Unlike ``lax.while_loop`` it can be reverse-differentiated. The
    backward pass gets each step's carry by inverting ``body_fun`` where the
    analysis can, storing the leaves it cannot when ``max_steps`` bounds the
    loop, and by binomial checkpointing otherwise (see :mod:`revnet.loops` for
    the rule). Its cost follows the steps actually taken, not ``max_steps``.

    ``cond_fun`` may depend on the carry (data-dependent stopping); it gets no
    gradient (the loop's output is piecewise in it), and is not re-evaluated in
    the backward pass. Under ``vmap``, elements that stop at different steps
    each get their own trip count and exact gradients. (JAX batches a custom
    VJP's backward pass element by element, so the cotangents of weights
    shared by the batch are accumulated per element, ``batch`` times the
    weights' size, and summed afterwards. When all elements take the same
    number of steps, carrying the batch in ``val`` avoids that.)

    Example:

        >>> def body(c):  # invertible in (x, v); the running maximum is stored
        ...     x, v, top = c
        ...     v = v - 0.1 * jnp.sin(x)
        ...     x = x + 0.1 * v
        ...     return x, v, jnp.maximum(top, jnp.max(x))
        >>> init = (jnp.ones(3), jnp.zeros(3), 0.0)
        >>> x, v, top = revnet.while_loop(
        ...     lambda c: c[2] < 2.0, body, init, max_steps=50, mode="store")
        >>> x.shape
        (3,)

    Args:
      cond_fun: ``cond_fun(val) -> bool scalar``.
      body_fun: ``body_fun(val) -> val``, any function that keeps the carry's
        structure, shapes and dtypes.
      init_val: the initial carry, a pytree of arrays or Python scalars (these
        take the dtype ``body_fun`` returns for them, as in ``lax.while_loop``).
      max_steps: optional bound on the number of steps, a non-negative integer
        known at trace time.
      checkpoints: when checkpointing, how many carries the backward pass may
        hold at once, the initial one included (at least 1; at most
        ``max_steps + 1`` are used). Default: ``ceil(log2(max_steps))``, for
        which no step is evaluated more than ``ceil(log2 n) + 1`` times in the
        backward pass of an ``n``-step loop; 16 without ``max_steps``. Memory
        is ``checkpoints`` carries; fewer snapshots cost more recomputation.
      mode: ``"auto"`` (the default) picks the backward mode by the rule
        above; ``"invert"`` requires the whole carry to be rebuilt by
        inversion; ``"store"`` inverts what can be rebuilt and stores the rest
        at every step (needs ``max_steps``); ``"checkpoint"`` checkpoints
        even an invertible body (for ill-conditioned inverses).
      anchor_every: as in :func:`scan` (needs ``max_steps``: room is made
        for ``ceil(max_steps / anchor_every)`` carries).
      drift: as in :func:`scan`; without ``anchor_every`` the initial carry is
        stored and the whole loop's reconstruction error reported.
      decisions: ``"store"`` (the default) or ``"recompute"``, as in
        :func:`scan`. The results of ``body_fun`` that jump on the carry
        (comparisons, ``argmax``, ``round``, see :func:`revnet.invertible`),
        and with ``kinks="store"`` its kinks, are stored at every step in room
        for ``max_steps`` steps when the carry is rebuilt. Without
        ``max_steps`` there is no room for them: such a body is checkpointed
        (which recomputes them exactly), and ``mode="invert"`` is refused;
        ``"recompute"`` (with ``kinks="recompute"``) lets it be inverted.
      kinks: as in :func:`revnet.invertible`; stored like decisions.
      invert: deprecated: ``True``, ``False`` and ``None`` are
        ``mode="invert"``, ``"checkpoint"`` and ``"auto"``.

    Returns:
      The final carry, with the structure of ``init_val``.

    Raises:
      NotInvertibleError: with ``mode="invert"``, when ``body_fun`` cannot be
        inverted in the carry; the message names the equation, the carry leaf
        and the source line.
      TypeError: when ``cond_fun`` or ``body_fun`` is not callable,
        ``max_steps`` or ``checkpoints`` is not an integer (a bool is not
        one), both ``invert`` and ``mode`` are given, ``cond_fun`` does not
        return a boolean scalar, ``body_fun`` changes the carry's type, or
        forward-mode differentiation reaches the loop.
      ValueError: when ``mode`` is not one of the four modes, ``mode="store"``
        is given without ``max_steps``, ``mode="invert"`` is given without
        ``max_steps`` for a body with decisions (or kinks, with
        ``kinks="store"``) on the carry, ``max_steps`` is negative,
        ``checkpoints`` or ``anchor_every`` is below 1, or ``anchor_every`` is
        given without ``max_steps``.
    """
    o = loop_options.while_options(
        cond_fun,
        body_fun,
        max_steps,
        checkpoints=checkpoints,
        mode=mode,
        invert=invert,
        anchor_every=anchor_every,
        drift=drift,
        decisions=decisions,
        kinks=kinks,
    )
    body = common.traced_body(body_fun, "body_fun", init_val, "init_val", o)
    cond_jaxpr, cond_consts = common.traced_cond(cond_fun, body)
    jaxpr, chosen, decided = common.backward_mode(body, o)
    o = common.armed(o, body, jaxpr, chosen)
    report = common.reporter(o, body)
    run = while_function(
        jaxpr,
        cond_jaxpr,
        chosen,
        body.nk,
        o.bound,
        o.slots,
        o.anchor_every,
        report,
        decided,
    )
    final = common.call("while_loop", run, list(body.consts), cond_consts, body.carry)
    return body.unflatten(final)


def scan(
    f: Callable[[Any, Any], tuple[Any, Any]],
    init: Any,
    xs: Any = None,
    length: int | None = None,
    reverse: bool = False,
    unroll: int | bool = 1,
    *,
    checkpoints: int | None = None,
    mode: str = loop_options.AUTO,
    anchor_every: int | None = None,
    drift: DriftMonitor | None = None,
    decisions: str = "store",
    kinks: str = "recompute",
    invert: Any = loop_options.UNSET,
) -> tuple[Any, Any]:
    """``lax.scan`` with a memory-lean VJP, for any body.

    Computes the same values as ``jax.lax.scan(f, init, xs, length, reverse,
    unroll)`` and accepts the same arguments: any pytree as the carry (tuples,
    lists, dicts, None leaves), Python scalars in ``init`` (promoted to the
    dtype ``f`` returns for them, as ``lax.scan`` does), and ``f`` returning
    any pytree node with two children as ``(carry, y)`` (a tuple or a list).
    Under reverse-mode differentiation the forward pass saves the stacked
    outputs ``ys`` (which are outputs anyway), ``xs``, the values ``f`` closes
    over, and, by the mode :mod:`revnet.loops` describes: the final carry
    (invertible ``f``), the carry leaves inversion cannot rebuild, one per
    step (partly invertible ``f``), or the initial carry (checkpointing). The
    backward pass is one loop over the steps, fused with ``f``'s VJP.

    Example:

        >>> def step(c, w):
        ...     x1, x2 = c
        ...     x1 = x1 + jnp.tanh(x2 * w[0])
        ...     x2 = x2 + jnp.tanh(x1 * w[1])
        ...     return (x1, x2), jnp.mean(x2)
        >>> init = (jnp.ones(3), jnp.zeros(3))
        >>> (x1, x2), means = revnet.scan(step, init, jnp.ones((8, 2)))
        >>> means.shape
        (8,)

    Args:
      f: ``f(carry, x) -> (carry, y)``; the carry it returns must have the
        structure, shapes and dtypes of the one it takes. Integer leaves of
        the carry get no gradient.
      init: the initial carry, a pytree of arrays or Python scalars.
      xs: a pytree of arrays with a common leading axis to scan over, or None.
      length: the number of steps, a non-negative integer known at trace time;
        required when ``xs`` is None.
      reverse: scan from the end of ``xs`` to the start, as in ``lax.scan``.
      unroll: as in ``lax.scan``: how many steps run within one iteration of the
        compiled loop; True unrolls the whole loop, False (or 1) none of it, and
        0 also the whole loop. It applies to the forward scan and to the
        backward reverse scan alike (not to checkpointing's recomputation), and
        changes speed and compile time, never the values.
      checkpoints: when checkpointing, how many carries the backward pass may
        hold at once, the initial one included (at least 1; at most ``length
        + 1`` are used). Default: ``ceil(log2(length))``, for which no step is
        evaluated more than ``ceil(log2 length) + 1`` times in the backward
        pass.
      mode: ``"auto"`` (the default) picks the backward mode by the rule of
        :mod:`revnet.loops`; ``"invert"`` requires the whole carry to be
        rebuilt by inversion; ``"store"`` inverts what can be rebuilt and
        stores the rest at every step; ``"checkpoint"`` checkpoints even an
        invertible ``f``.
      anchor_every: None, or a positive integer ``k``: when the carry is
        rebuilt by inversion, the forward pass also stores it before every
        ``k``-th step (``ceil(length / k)`` carries) and the backward pass
        continues from each stored carry, so reconstruction error accumulates
        over at most ``k`` steps (:mod:`revnet.drift`). Costs no extra body
        evaluation. Checkpointing recomputes exactly and stores no anchors.
      drift: None, or a :class:`revnet.DriftMonitor` that every backward pass
        sends the reconstruction error at each anchor to (without
        ``anchor_every``, the initial carry is stored and the error of the
        whole loop is reported).
      decisions: ``"store"`` (the default): when the carry is rebuilt, the
        results of ``f`` that jump and read it (comparisons, ``argmax``,
        ``top_k`` indices, ``round``; see :func:`revnet.invertible`) are
        stored at every step and not made again on rebuilt values;
        ``"recompute"`` stores no decision.
      kinks: as in :func:`revnet.invertible`; with ``"store"`` the kinks are
        stored at every step too, whatever ``decisions`` is.
      invert: deprecated: ``True``, ``False`` and ``None`` are
        ``mode="invert"``, ``"checkpoint"`` and ``"auto"``.

    Returns:
      ``(final_carry, ys)`` with ``ys`` stacked along a leading axis, in the
      container ``f`` returns (a tuple, or a list when ``f`` returns a list).

    Raises:
      NotInvertibleError: with ``mode="invert"``, when ``f`` cannot be
        inverted in the carry.
      TypeError: when ``f`` is not callable, does not return a pair, or changes
        the carry's type; when ``length``, ``reverse``, ``unroll`` or
        ``checkpoints`` has the wrong type (a bool is not a length; a traced
        value is not allowed); when both ``invert`` and ``mode`` are given; or
        when forward-mode differentiation reaches the loop.
      ValueError: when ``mode`` is not one of the four modes, when the lengths
        of ``xs`` and ``length`` disagree or neither is given, when ``length``
        or ``unroll`` is negative, or when ``checkpoints`` or ``anchor_every``
        is below 1.
    """
    o = loop_options.scan_options(
        f,
        xs,
        length,
        reverse,
        unroll,
        checkpoints=checkpoints,
        mode=mode,
        invert=invert,
        anchor_every=anchor_every,
        drift=drift,
        decisions=decisions,
        kinks=kinks,
    )
    body = common.traced_body(f, "f", init, "init", o)
    jaxpr, chosen, decided = common.backward_mode(body, o)
    o = common.armed(o, body, jaxpr, chosen)
    sp = ScanParams(Body(jaxpr, ()), body.nk, body.nc, o.bound, o.reverse, o.unroll)
    run = scan_function(
        sp, chosen, o.slots, o.anchor_every, common.reporter(o, body), decided
    )

    def again(fun, c, x):  # under jax.vmap: the scan of the batched body
        return scan(fun, c, x, o.bound, o.reverse, o.unroll, **o.again)

    # The named refusal of forward mode, around the call and what it runs.
    run_scan = lambda *g: common.call("scan", run, *g)  # noqa: E731
    final, ys = common.call(
        "scan",
        scan_call,
        *(body.program, o.bound, run_scan, body.consts, body.carry, o.xs, again),
    )
    return body.unflatten(list(final) + ys)
