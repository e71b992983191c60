"""The program pipeline: a user's call traced, its decisions exposed, its
inversion planned.

Every front end that runs a user's function backwards goes through here:
``revnet.invertible``, ``revnet.inverse``, ``revnet.forward_and_log_det`` and
the bodies of ``revnet.scan`` and ``revnet.while_loop``. The steps, in order:

1. **The call, flat** (:func:`flat_call`): the known arguments
   (``known_argnums``) closed over, the rebuilt ones checked and flattened.
2. **Traced** (:func:`.tracing.trace_program`) to an open jaxpr whose first
   inputs are the values the function closes over.
3. **Decisions exposed** as one :class:`Storage` value says
   (:mod:`.decisions`), and the program solved with them
   (:func:`solve_exposed`). A select on the inverted path whose predicate the
   rebuilt values do not give is solved only with its predicate known: when
   the program is stuck with those predicates recomputed, they are stored
   too. When it is stuck either way, the refusal is the program's own (its
   equation, not a stored decision's).
4. **Planned** (:func:`.analysis.analyze`), or refused with the user's
   :class:`~.errors.NotInvertibleError`.

:func:`prepare` runs the four steps. A loop traces its body on its own terms
(its carry promoted as ``lax.scan`` does) and calls :func:`solve_exposed`
with its choice of backward mode (:mod:`.loops.choose`).

A new storage option is one field of :class:`Storage` with its choices, and
its use in the decision pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from revnet._engine import known_args
from revnet._engine.analysis import analyze
from revnet._engine.decisions import DECISIONS, KINKS, Exposed, expose
from revnet._engine.errors import NotInvertibleError, Stuck, not_invertible
from revnet._engine.plan import Plan
from revnet._engine.tracing import trace_program


@dataclasses.dataclass(frozen=True)
class Storage:
    """What the forward pass stores besides the outputs: one frozen value.

    Make it with :meth:`checked` where a user gives the options; every holder
    (a decorated function, a stack's options, a loop's options) keeps this one
    value.

    Attributes:
      decisions: ``"store"`` (the default): results that jump and read
        rebuilt values are stored; ``"recompute"``: made again on rebuilt
        values.
      kinks: ``"recompute"`` (the default), or ``"store"``: every kink
        reading rebuilt values is stored too.
    """

    decisions: str = dataclasses.field(default="store", metadata={"choices": DECISIONS})
    kinks: str = dataclasses.field(default="recompute", metadata={"choices": KINKS})

    @classmethod
    def checked(cls, where: str, **options: Any) -> Storage:
        """The storage options a user gave, checked once.

        Args:
          where: The function or module they were given to, for messages.
          **options: The fields, by name (``decisions=``, ``kinks=``).

        Returns:
          The value.

        Raises:
          ValueError: For an option that is not one of its choices, in one
            line naming it, ``where`` and the choices.

        Example::

            storage = Storage.checked("invertible", decisions="recompute")
        """
        for field in dataclasses.fields(cls):
            value = options.get(field.name, field.default)
            choices = field.metadata["choices"]
            if not isinstance(value, str) or value not in choices:
                raise ValueError(
                    f"{where}: {field.name} must be one of {choices}, got {value!r}"
                )
        return cls(**options)

    def expose(
        self, jaxpr: Any, rebuilt: Sequence[bool], *, soft: bool = True
    ) -> Exposed:
        """``jaxpr`` with the decisions these options store as extra outputs
        (:func:`.decisions.expose`)."""
        return expose(jaxpr, rebuilt, **dataclasses.asdict(self), soft=soft)


def solve_exposed(
    jaxpr: Any,
    rebuilt: Sequence[bool],
    storage: Storage,
    solve: Callable[[Exposed], Any],
    *,
    enough: Callable[[Any], bool] = lambda found: True,
) -> tuple[Exposed, Any]:
    """``(exposed, solve(exposed))`` for ``jaxpr`` with its decisions exposed.

    Args:
      jaxpr: An open jaxpr (constants as leading inputs).
      rebuilt: For each input, whether the backward pass rebuilds it.
      storage: What is stored.
      solve: Plans an exposed program (an inversion plan, a loop's backward
        mode), raising :class:`~.errors.Stuck` when it cannot.
      enough: Whether a result needs no retry; a result that is not enough
        (a loop that would store or checkpoint rather than invert) is
        replaced by the strict exposure's when that one is.

    Returns:
      The exposed program and its plan: the soft exposure's (selects
      solved case by case with their predicates recomputed), else the
      strict one's (those predicates stored too).

    Raises:
      Stuck: When neither exposure can be solved: the program's own, when
        it is stuck without its decisions exposed too, else the last
        exposure's, with ``by_decisions`` set.
    """
    soft = storage.expose(jaxpr, rebuilt)
    found, stuck = _attempt(solve, soft)
    if found is not None and enough(found):
        return soft, found
    strict = storage.expose(jaxpr, rebuilt, soft=False)
    if strict.n != soft.n:
        again, stuck_strict = _attempt(solve, strict)
        if again is not None and (found is None or enough(again)):
            return strict, again
        stuck = stuck_strict or stuck
    if found is not None:
        return soft, found
    _, own = _attempt(solve, Exposed(jaxpr, 0))
    if own is not None:
        raise own
    stuck.by_decisions = True
    raise stuck


def _attempt(solve: Callable[[Exposed], Any], exposed: Exposed):
    """``(solve(exposed), None)``, or ``(None, stuck)``."""
    try:
        return solve(exposed), None
    except Stuck as stuck:
        return None, stuck


def check_args(args: tuple, name: str) -> None:
    """A TypeError unless ``args`` are pytrees of arrays and numbers."""
    for leaf in jax.tree_util.tree_leaves(args):
        if not hasattr(leaf, "dtype") and not isinstance(leaf, (int, float)):
            raise TypeError(
                f"{name}: positional arguments must be pytrees of arrays, got a leaf "
                f"of type {type(leaf).__name__}"
            )


@dataclasses.dataclass(frozen=True)
class Call:
    """A user's call, flat: ``fun(*args)`` with the known arguments closed over.

    Attributes:
      name: The function's name, for messages.
      fun: The function of the rebuilt arguments' leaves.
      args: Those leaves.
      in_tree: Their tree.
      given: The call's arguments, as given.
      known: The positions of the known arguments among them.
    """

    name: str
    fun: Callable[..., Any]
    args: list
    in_tree: Any
    given: tuple
    known: list[int]

    def paths(self) -> list[str]:
        """The name of each leaf of ``args`` (``args[1]['x']``)."""
        return known_args.rebuilt_paths(self.given, self.known)

    def inputs(self, leaves: Sequence[Any]) -> tuple:
        """All the call's arguments: the known ones as given, the others from
        the rebuilt ``leaves``."""
        rebuilt = jax.tree_util.tree_unflatten(self.in_tree, list(leaves))
        return known_args.merge(self.given, self.known, rebuilt)


def flat_call(
    fun: Callable[..., Any], args: tuple, known_argnums: Sequence[int], *, name: str
) -> Call:
    """``fun(*args)`` as a :class:`Call`; TypeErrors name a bad argument."""
    known = known_args.positions(tuple(known_argnums), len(args), name)
    closed, rest = known_args.close_over(fun, args, known)
    check_args(rest, name)
    leaves, in_tree = jax.tree_util.tree_flatten(rest)

    def flat_fun(*flat):
        return closed(*jax.tree_util.tree_unflatten(in_tree, flat))

    return Call(name, flat_fun, leaves, in_tree, args, known)


@dataclasses.dataclass(frozen=True)
class Program:
    """A call traced and planned.

    Attributes:
      call: The call.
      jaxpr: The program the analysis read (:func:`.tracing.trace`).
      program: ``jaxpr`` as traced, before preparation (a batched call
        evaluates it).
      consts: The values it closes over, its first inputs.
      args: The flat arguments it was traced on, its other inputs.
      out_tree: The tree of its result.
      exposed: ``jaxpr`` with its stored decisions as extra outputs.
      plan: The plan rebuilding ``exposed``'s inputs from its outputs.
    """

    call: Call
    jaxpr: Any
    program: Any
    consts: list
    args: list
    out_tree: Any
    exposed: Exposed
    plan: Plan


def prepare(
    fun: Callable[..., Any],
    args: tuple,
    known_argnums: Sequence[int],
    storage: Storage | None,
    *,
    name: str,
    traced: bool = True,
) -> Program:
    """``fun(*args)`` traced, its decisions exposed and its inversion planned.

    Args:
      fun: The user's function.
      args: Its positional arguments (arrays or ``jax.ShapeDtypeStruct``s).
      known_argnums: The positions of the known arguments.
      storage: What the forward pass stores; None for an inverse run on
        values alone, which exposes nothing.
      name: The function's name, for messages.
      traced: Whether a call of the function is being traced (False for
        ``revnet.inverse``), which a refusal explains.

    Returns:
      The program.

    Raises:
      NotInvertibleError: When the program cannot be inverted, naming its
        equation and source line; where saving one more argument would make
        it invertible, its ``try:`` line names ``known_argnums``.

    Example::

        program = prepare(block, (x1, x2), (), Storage(), name="block")
    """
    return plan_call(flat_call(fun, args, known_argnums, name=name), storage, traced)


def plan_call(
    call: Call,
    storage: Storage | None,
    traced: bool = True,
    fun: Callable[..., Any] | None = None,
    args: Sequence[Any] | None = None,
) -> Program:
    """:func:`prepare` of a flat call; ``fun`` and ``args`` replace the
    call's own (a batched program of the same arguments)."""
    fun = call.fun if fun is None else fun
    args = call.args if args is None else list(args)
    jaxpr, program, consts, out_tree = trace_program(fun, args)
    n_consts, n_args = len(consts), len(args)
    known_in = (True,) * n_consts + (False,) * n_args
    rebuilt = [not k for k in known_in]

    def solve(exposed: Exposed) -> Plan:
        return analyze(exposed.jaxpr, known_in, (True,) * len(exposed.jaxpr.outvars))

    try:
        if storage is None:
            exposed = Exposed(jaxpr, 0)
            plan = solve(exposed)
        else:
            exposed, plan = solve_exposed(jaxpr, rebuilt, storage, solve)
    except Stuck as stuck:
        raise _refusal(stuck, call, jaxpr, n_consts, traced) from None
    return Program(call, jaxpr, program, consts, args, out_tree, exposed, plan)


def _refusal(
    stuck: Stuck, call: Call, jaxpr: Any, n_consts: int, traced: bool
) -> NotInvertibleError:
    """The user's error for ``stuck``; where it is stuck for want of an
    argument that saving instead of rebuilding would give (weights passed as
    an argument), its ``try:`` line names ``known_argnums``."""
    error = not_invertible(stuck, call.paths(), n_consts, call.name, traced=traced)
    if stuck.by_decisions:  # saving an argument would not help
        return error
    hint = known_args.suggestion(stuck, jaxpr, n_consts, call.given, call.known)
    if hint is None:
        return error
    head = str(error).split("\ntry:")[0]  # the more specific remedy
    return NotInvertibleError(f"{head}\n{hint}")
