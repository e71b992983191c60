"""The custom VJP of revnet's loops: one builder for ``while_loop`` and ``scan``.

:func:`while_function` and :func:`scan_function` describe their loop as a
:class:`Loop` (a scan whose length a while loop reads at run time, plus how
its arguments and results are laid out) and hand it to :func:`_loop_vjp`,
which builds the ``jax.custom_vjp`` in the mode :mod:`.choose` picked:

* **invert** and **store** (:mod:`.invert`, :mod:`.store`): the forward pass
  saves the final carry, ``ys``, the stored leaves and anchors; the backward
  pass walks back from the final carry.
* **checkpoint** (:mod:`.checkpoint`): the forward pass saves the initial
  carry; the backward pass recomputes carries by :mod:`.revolve`.

Both save the constants, ``xs`` and a while loop's trip count, and run only
the steps the forward pass took. The forward loops come from
:mod:`.forward`. The backward functions are tagged with a :class:`LoopTag`,
so that the analysis recognises a loop inside an ``@invertible`` function.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from revnet._engine import cotangents
from revnet._engine import jaxpr as jx
from revnet._engine import perturbed as pb
from revnet._engine.decisions import residuals
from revnet._engine.jaxpr import LoopTag
from revnet._engine.loops import anchors as anc
from revnet._engine.loops import checkpoint, forward, invert
from revnet._engine.loops.choose import CHECKPOINT, Mode
from revnet._engine.loops.hooks import MODE_HOOKS

SCAN, WHILE = "scan", "while_loop"


@dataclasses.dataclass(frozen=True)
class Loop:
    """What distinguishes one loop for the custom-VJP builder.

    A loop takes ``(consts, cond_consts, carry)`` (``while_loop``) or
    ``(consts, carry, xs)`` (``scan``) and returns the final carry
    (``while_loop``) or ``(final, ys)`` (``scan``).

    Attributes:
      kind: ``"scan"`` or ``"while_loop"``.
      sp: the loop as a scan over its body (constants, carry, ``xs`` ->
        carry, ``ys``); ``length`` is None for a while loop.
      cond_avals: the avals of a while loop's condition constants (they get
        zero cotangents); empty for a scan.
      forwards: ``forwards(stored, anchor_every)``, the loop's forward loops
        (:mod:`.forward`).
      decided: what the body's last ``ys`` are (a while loop's: its results
        after the carry), one :class:`~revnet._engine.decisions.Kept` each:
        the decisions it stores.
    """

    kind: str
    sp: jx.ScanParams
    cond_avals: Sequence[Any]
    forwards: Callable[[tuple[bool, ...], int | None], forward.Forwards]
    decided: Sequence[Any] = ()

    def groups(self, args: Sequence[Any]) -> tuple[Any, Any, Any, Any]:
        """``(consts, cond_consts, carry, xs)`` from the loop's arguments."""
        if self.kind == WHILE:
            return args[0], args[1], args[2], []
        return args[0], [], args[1], args[2]

    def outputs(self, final: Sequence[Any], ys: Sequence[Any]) -> Any:
        """The loop's result."""
        return final if self.kind == WHILE else (final, ys)

    def out_cts(self, cts: Any) -> tuple[Any, Any]:
        """``(final carry, ys)`` cotangents from the result's."""
        return (cts, []) if self.kind == WHILE else cts

    def perturbed(self, flags: Sequence[bool]) -> tuple[list, list, list]:
        """Which constants, carry leaves and ``xs`` are differentiated, from the
        flags of the loop's arguments (condition constants dropped)."""
        nk, nc, nq = self.sp.num_consts, self.sp.num_carry, len(self.cond_avals)
        flags = list(flags)
        return flags[:nk], flags[nk + nq : nk + nq + nc], flags[nk + nq + nc :]

    def in_cts(self, ct_k: list, ct_c: list, ct_x: list) -> tuple:
        """The cotangents of the loop's arguments, each of its primal's type."""
        sp, invars = self.sp, self.sp.body.jaxpr.invars
        nk, nc = sp.num_consts, sp.num_carry
        avals = [jx.aval(v) for v in invars]
        ct_k = cotangents.fill(ct_k, avals[:nk])
        ct_c = cotangents.fill(ct_c, avals[nk : nk + nc])
        if self.kind == WHILE:
            return ct_k, [cotangents.zeros(a) for a in self.cond_avals], ct_c
        x_avals = [jx.stacked(a, sp.length) for a in avals[nk + nc :]]
        return ct_k, ct_c, cotangents.fill(ct_x, x_avals)


def while_function(
    body_jaxpr: Any,
    cond_jaxpr: Any,
    mode: Mode,
    nk: int,
    bound: int | None,
    slots: int,
    anchor_every: int | None = None,
    report: Any = None,
    decided: Sequence[Any] = (),
) -> Callable[..., Any]:
    """``run(body_consts, cond_consts, carry) -> carry``, a custom VJP while loop.

    Args:
      body_jaxpr, cond_jaxpr: the body and condition, constants first; the
        body returns the carry, then (with a ``bound``) ``decided``.
      mode: how the backward pass gets each carry (:mod:`.choose`).
      nk: the number of the body's constants.
      bound: the largest number of steps, or None.
      slots: the number of snapshots when checkpointing.
      anchor_every: as in :func:`scan_function`; room is made for the anchors
        of ``bound`` steps (of one step without a bound: the initial carry).
      report: as in :func:`scan_function`.
      decided: the records of the decisions the body returns after its carry
        (:class:`~revnet._engine.decisions.Kept`), stored at every step in
        room for ``bound`` steps.

    Returns:
      The loop, a ``jax.custom_vjp`` function.

    Example::

        run = while_function(body, cond, mode, 1, 100, 7)
        final = run(body_consts, cond_consts, init)
    """
    nc = len(body_jaxpr.invars) - nk
    if decided and bound is None:
        raise ValueError("while_function: stored decisions need a bound")
    sp = jx.ScanParams(jx.Body(body_jaxpr, ()), nk, nc, None, False)
    n_cond = len(cond_jaxpr.invars) - nc
    loop = Loop(
        WHILE,
        sp,
        [jx.aval(v) for v in cond_jaxpr.invars[:n_cond]],
        lambda stored, every: forward.while_forwards(
            body_jaxpr, cond_jaxpr, bound, stored, every
        ),
        tuple(decided),
    )
    return _loop_vjp(loop, mode, slots, anchor_every, report)


def scan_function(
    sp: jx.ScanParams,
    mode: Mode,
    slots: int,
    anchor_every: int | None = None,
    report: Any = None,
    decided: Sequence[Any] = (),
) -> Callable[..., Any]:
    """``run(consts, init, xs) -> (final, ys)``, a custom VJP for the scan ``sp``.

    Args:
      sp: the scan; its body's inputs are the constants, carry and ``xs``.
      mode: how the backward pass gets each carry (:mod:`.choose`).
      slots: the number of snapshots when checkpointing.
      anchor_every: when inverting, store the carry every ``anchor_every``
        steps and continue the backward pass from it (:mod:`.anchors`).
        Checkpointing recomputes carries exactly and uses no anchors.
      report: with anchors, None or a function given the drift at each
        anchor (through ``jax.debug.callback``) by every backward pass.
      decided: the records of the decisions the body returns as its last
        ``ys`` (:class:`~revnet._engine.decisions.Kept`), for the report of
        what is stored (:mod:`revnet._engine.decisions.residuals`).

    Returns:
      The scan, a ``jax.custom_vjp`` function.

    Example::

        run = scan_function(sp, mode, 4)
        final, ys = run(consts, init, xs)
    """
    loop = Loop(
        SCAN,
        sp,
        [],
        lambda stored, every: forward.scan_forwards(sp, stored, every),
        tuple(decided),
    )
    return _loop_vjp(loop, mode, slots, anchor_every, report)


def _loop_vjp(
    loop: Loop,
    mode: Mode,
    slots: int,
    anchor_every: int | None,
    report: Any,
) -> Callable[..., Any]:
    """The custom-VJP function of ``loop`` in ``mode``; the testing hooks in
    :data:`.hooks.MODE_HOOKS` are given ``mode``."""
    for hook in tuple(MODE_HOOKS):
        hook(mode)
    rebuild = mode.kind != CHECKPOINT  # invert and store walk back from the end
    loops = loop.forwards(mode.stored, anchor_every if rebuild else None)
    every = loops.every

    @jax.custom_vjp
    def run(*args):
        ran = loops.primal(*args)
        return loop.outputs(ran.final, ran.ys)

    def fwd(*args):
        args, flags = pb.split_primals(args)
        consts, _, carry, xs = loop.groups(args)
        ran = loops.anchored(*args)
        out = loop.outputs(ran.final, ran.ys)
        if not rebuild:  # checkpointing starts from the initial carry
            ran = forward.Ran(ran.steps, list(carry), [], [], [])
        residuals.loop(loop.kind, loop.sp, mode, every, loop.decided, consts, xs, ran)
        first = [] if mode.derived is None else mode.derived.initial(carry)
        return out, (consts, xs, ran, first, pb.Flags(flags))

    def bwd(res, cts):
        consts, xs, ran, first, flags = res
        cts = loop.out_cts(pb.drop_symbolic_zeros(cts))
        perturbed = loop.perturbed(flags.value)
        if rebuild:
            anchors = None if every is None else anc.Anchors(every, ran.anchors, report)
            ct_k, ct_c, ct_x = invert.backward(
                loop.sp, mode, consts, xs, ran, cts, perturbed, anchors, first
            )
        else:
            ct_k, ct_c, ct_x = checkpoint.backward(
                loop.sp, consts, xs, ran.final, ran.steps, cts, perturbed, slots
            )
        return loop.in_cts(ct_k, ct_c, ct_x)

    jx.tag(bwd, LoopTag(loop.kind))  # recognised by the analysis
    run.defvjp(fwd, bwd, symbolic_zeros=True)
    return run
