"""The rule table: every way the analysis can solve an equation, by primitive.

One table holds two kinds of rule, looked up by primitive name:

* :class:`InverseRule`, a primitive's inverse: ``solve(outs, ins, **params)``
  returns the full list of inputs from the outputs and the known inputs
  (``None`` where unknown). Its properties are recorded once, here:
  ``elementwise`` (output element ``k`` depends on input element ``k`` only,
  so that ``select_n``'s cases can be inverted position by position) and
  ``takes_avals`` (the rule declares a keyword argument ``in_avals``, and is
  given the abstract values, shapes and dtypes, of all the equation's
  inputs: the only way to know the shape of an unknown input), and
  ``log_det``, the equation's term of the log-determinant (see below).
* :class:`StructuralRule`, for equations solved by looking beyond one
  equation: nested calls, ``scan``, ``select_n``, covering ``slice``\\ s,
  ``custom_vjp`` calls and revnet's own loops. Its ``analyze`` hook is called
  by the analysis and returns a plan step, which the interpreter runs through
  the handler the same module registers. Its ``positionwise`` hook says
  whether the equation may lie on a ``select_n`` case's chain.

**Log-determinant terms.** Ordered as the plan solves them, a program's
equations factor its Jacobian into triangular blocks, so ``log|det J|`` is the
sum over the solved equations of ``log|det d(outputs)/d(solved input)|``
(:mod:`revnet._engine.log_det`). A rule's ``log_det`` gives that term:
``log_det(outs, ins, unknown, **params)`` with every value known (the forward
pass's) and ``unknown`` the position of the input the rule solves. It returns
an array of the solved input's rank; an axis of size 1 where the input's is
longer means the term already sums over that axis (``dot_general``'s
``slogdet`` per row). ``0`` marks a rule whose term is zero (additions of a
known value, layout ops); a rule without one has no log-determinant, and a
log-determinant that needs it is refused.

**One place per primitive.** Each of revnet's built-in rules is declared by
:func:`define`, beside its rule in :mod:`revnet.rules`, with every fact revnet
keeps of the primitive, by keyword: its inverse, trace-time check,
``elementwise`` flag, log-determinant term, and its *continuity class*, what
its result does when a rebuilt input moves by rounding (:data:`CONTINUITY`;
the classification is :mod:`revnet._engine.decisions.continuity`'s, which
declares the classes of the primitives that have no inverse rule). Adding an
elementwise bijection is one call::

    define("sinh", inverse=unary(jnp.arcsinh), continuity=SMOOTH,
           elementwise=True, log_det=unary_term(lambda x, y: jnp.log(jnp.cosh(x))))

:func:`register_inverse` is the public way to add a primitive's inverse;
:func:`names` and :func:`get` list the table. Every change bumps
:func:`version`, which is part of the plan cache's key.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from revnet._engine.sharded_types import cast_like

InverseRuleFn = Callable[..., Sequence[Any]]
LogDetFn = Callable[..., Any]


def _takes_avals(fn: Callable[..., Any] | None) -> bool:
    if fn is None:
        return False
    try:
        return "in_avals" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


@dataclasses.dataclass(frozen=True)
class InverseRule:
    """A primitive's inverse rule.

    Attributes:
      name: the primitive's name.
      solve: ``solve(outs, ins, **params) -> ins``; ``ins`` holds None for the
        unknown inputs. It raises ``NotInvertibleError`` when it cannot solve.
      check: optional trace-time check ``check(statics, **params)``;
        ``statics`` holds the concrete value of each known input that is
        fixed at trace time (a literal, or computed from literals), None for
        the others. It raises ``NotInvertibleError`` when such a value loses
        information (a multiplication by a constant zero).
      elementwise: whether the primitive maps each element to the element at
        the same position.
      takes_avals: whether ``solve``/``check`` take ``in_avals``, the abstract
        values of all the equation's inputs (detected from their signatures).
      log_det: the equation's log-determinant term (see the module's
        docstring), ``0`` where it is zero, or None where there is none.
    """

    name: str
    solve: InverseRuleFn
    check: Callable[..., None] | None = None
    elementwise: bool = False
    takes_avals: bool = False
    log_det: LogDetFn | int | None = None
    structural = False

    def __call__(self, outs: Sequence[Any], ins: Sequence[Any], params, in_avals):
        """Runs ``solve`` with the equation's params (and ``in_avals``).

        Each solved input is given its type's sharding (Explicit axes, varying
        manual axes): a rule computes values, the engine keeps their types.
        """
        extra = {"in_avals": list(in_avals)} if self.takes_avals else {}
        result = self.solve(outs, ins, **params, **extra)
        if isinstance(result, (list, tuple)) and len(result) == len(ins):
            result = [
                cast_like(r, a) if x is None else r
                for r, x, a in zip(result, ins, in_avals)
            ]
        return result

    @property
    def volume_preserving(self) -> bool:
        """Whether the rule's log-determinant term is zero."""
        return _is_zero(self.log_det)

    def term(self, outs, ins, unknown: int, params, in_avals) -> Any:
        """The log-determinant term for input ``unknown`` (None where zero)."""
        if self.log_det is None or self.volume_preserving:
            return None
        extra = {"in_avals": list(in_avals)} if _takes_avals(self.log_det) else {}
        return self.log_det(list(outs), list(ins), unknown, **params, **extra)

    def run_check(self, statics: Sequence[Any], params, in_avals) -> None:
        if self.check is not None:
            extra = {"in_avals": list(in_avals)} if _takes_avals(self.check) else {}
            self.check(statics, **params, **extra)


class StructuralRule:
    """A rule that solves an equation by a plan step of its own.

    Subclasses set ``name`` and implement ``analyze(analysis, i, eqn, ins,
    outs)``: ``ins``/``outs`` say which inputs and (not dropped) outputs of
    equation ``i`` are known. It returns ``(step, produced, eqns)`` (the step,
    the variable ids it makes known, the equations it settles) or None after
    recording why with ``analysis.fail``.
    """

    name: str = ""
    structural = True
    elementwise = False

    def analyze(self, analysis: Any, i: int, eqn: Any, ins, outs) -> Any:
        raise NotImplementedError

    def positionwise(self, analysis: Any, i: int, eqn: Any, unknown: int) -> bool:
        """Whether equation ``i`` maps its input ``unknown`` to its one output
        position by position (the other inputs known), and can be solved so.

        Such equations may lie on a ``select_n`` case's chain; the default is
        False. A rule that says True implements :meth:`solve_positionwise`.
        """
        return False

    def solve_positionwise(self, it: Any, i: int, eqn: Any, unknown: int, outs):
        """Input ``unknown`` of equation ``i`` rebuilt from the values ``outs``.

        The other inputs are read with ``it.read_in``; the result is exact at
        the positions where ``outs`` are the equation's true outputs.
        """
        raise NotImplementedError


_RULES: dict[str, Any] = {}
_VERSION = [0]


def _primitive_name(primitive: Any) -> str:
    if isinstance(primitive, str):
        return primitive
    name = getattr(primitive, "name", None)
    if not isinstance(name, str):
        raise TypeError(
            "register_inverse expects a JAX primitive or its name, got "
            f"{type(primitive).__name__}"
        )
    return name


def register(
    primitive: Any,
    solve: InverseRuleFn,
    check: Callable[..., None] | None = None,
    *,
    elementwise: bool = False,
    log_det: LogDetFn | int | None = None,
) -> InverseRule:
    """Registers (or replaces) a primitive's inverse rule, with its properties."""
    if not callable(solve):
        raise TypeError(f"register_inverse expects a callable rule, got {solve!r}")
    if check is not None and not callable(check):
        raise TypeError(f"register_inverse expects a callable check, got {check!r}")
    if not (log_det is None or callable(log_det) or _is_zero(log_det)):
        raise TypeError(
            f"register_inverse expects log_det to be a callable, 0 or None, got "
            f"{log_det!r}"
        )
    name = _primitive_name(primitive)
    rule = InverseRule(
        name, solve, check, bool(elementwise), _takes_avals(solve), log_det
    )
    _RULES[name] = rule
    _VERSION[0] += 1
    return rule


def _is_zero(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x == 0


def register_structural(names: Sequence[str], rule: StructuralRule) -> None:
    """Registers a structural rule for each primitive name in ``names``."""
    for name in names:
        _RULES[name] = rule
    _VERSION[0] += 1


def unregister(name: str) -> None:
    """Removes the rule of the primitive ``name`` (for tests)."""
    _RULES.pop(name, None)
    _VERSION[0] += 1


def register_inverse(
    primitive: Any,
    rule: InverseRuleFn,
    check: Callable[..., None] | None = None,
    *,
    elementwise: bool = False,
    log_det: LogDetFn | int | None = None,
) -> None:
    """Registers (or replaces) the inverse rule of ``primitive``.

    The rule is called as ``rule(outs, ins, **params)`` where ``outs`` lists
    the equation's outputs, ``ins`` its inputs with None for the unknown ones,
    and ``params`` are the equation's params (accept and ignore extras). It
    returns the full list of inputs. A rule that needs the shapes or dtypes of
    the inputs declares a keyword argument ``in_avals`` and receives the
    inputs' abstract values (``.shape``, ``.dtype``). The analysis first calls
    it on abstract values (``jax.eval_shape``), so it must decide from shapes,
    dtypes and params alone whether it applies.

    Example::

        def sinh_inverse(outs, ins, **params):
            return [jnp.arcsinh(outs[0])]

        revnet.register_inverse(jax.extend.core.primitives.sinh_p, sinh_inverse)

    Args:
      primitive: a JAX primitive (``jax.extend.core.primitives.exp_p``) or its
        name (``"exp"``).
      rule: ``rule(outs, ins, **params) -> ins``. Raise
        :class:`~revnet.NotInvertibleError` when it cannot solve.
      check: optional ``check(statics, **params)``, run at trace time with the
        known inputs whose values are fixed then (``None`` for the others);
        raise :class:`~revnet.NotInvertibleError` when those values lose
        information.
      elementwise: whether output element ``k`` depends on input element ``k``
        only (and the rule solves position by position), so that the rule may
        be used inside the cases of ``jnp.where``.
      log_det: the equation's term of the log-determinant, for
        :func:`revnet.forward_and_log_det`: ``log_det(outs, ins, unknown,
        **params)``, called with every input known and ``unknown`` the
        position of the input ``rule`` solves, returns ``log|d out/d in|``
        per element of that input (an array of its rank; an axis of size 1
        sums over that axis). ``0`` says the term is zero (a volume-preserving
        map). Without it, a log-determinant through this primitive is refused.

    Raises:
      TypeError: if ``primitive`` is neither a primitive nor a name, or
        ``rule``, ``check`` or ``log_det`` is not callable (``log_det`` may
        also be ``0``).
    """
    register(primitive, rule, check, elementwise=elementwise, log_det=log_det)


# --------------------------------------------------------------------------- #
# Continuity classes: what a rounding-sized move of a rebuilt float input does
# to the result (see revnet._engine.decisions.continuity).

SMOOTH, KINK, DECISION, GUARD, STRUCTURAL = (
    "smooth",
    "kink",
    "decision",
    "guard",
    "structural",
)
CONTINUITY = (SMOOTH, KINK, DECISION, GUARD, STRUCTURAL)
_CONTINUITY: dict[str, str] = {}


def declare_continuity(names: Sequence[str], cls: str) -> None:
    """Declares the continuity class of each primitive of ``names``.

    Raises:
      ValueError: If ``cls`` is not one of :data:`CONTINUITY`, or a primitive
        was declared already (one place per primitive).
    """
    if cls not in CONTINUITY:
        raise ValueError(f"continuity must be one of {CONTINUITY}, got {cls!r}")
    for name in names:
        old = _CONTINUITY.get(name)
        if old is not None:
            raise ValueError(
                f"primitive {name} is declared {old} already; declare each "
                "primitive in one place"
            )
        _CONTINUITY[name] = cls
    _VERSION[0] += 1


def continuity(name: str) -> str | None:
    """The declared continuity class of primitive ``name``, or None."""
    return _CONTINUITY.get(name)


def continuity_table() -> dict[str, str]:
    """Every declared continuity class, by primitive name."""
    return dict(_CONTINUITY)


def define(
    primitive: Any,
    *,
    inverse: InverseRuleFn,
    continuity: str,
    check: Callable[..., None] | None = None,
    elementwise: bool = False,
    log_det: LogDetFn | int | None = None,
) -> InverseRule:
    """Declares everything revnet keeps of one primitive, in one place.

    Args:
      primitive: A JAX primitive or its name.
      inverse: Its inverse rule, as for :func:`register_inverse`.
      continuity: Its continuity class, one of :data:`CONTINUITY`.
      check: Its trace-time check, as for :func:`register_inverse`.
      elementwise: Whether output element ``k`` depends on input element
        ``k`` only.
      log_det: Its log-determinant term; ``0`` where it is zero, None where
        there is none.

    Returns:
      The registered rule.

    Raises:
      TypeError: As :func:`register_inverse`.
      ValueError: For a continuity class that is not one, or a primitive
        declared already.
    """
    rule = register(primitive, inverse, check, elementwise=elementwise, log_det=log_det)
    declare_continuity([rule.name], continuity)
    return rule


def get(name: str) -> Any:
    """The registered rule of ``name`` (``.elementwise``, ``.structural``), or None."""
    return _RULES.get(name)


def names() -> list[str]:
    """The names of all primitives with a registered rule, sorted."""
    return sorted(_RULES)


def version() -> int:
    """A counter bumped by every change to the table."""
    return _VERSION[0]


# --------------------------------------------------------------------------- #
# Evaluators: primitives the interpreter evaluates (and differentiates) through
# a function of revnet's own instead of binding the equation. Values and
# derivatives must be the primitive's; only how XLA runs them may differ
# (convolutions in the layout XLA:CPU runs fast, see ``layout.py``).

Evaluator = Callable[[dict[str, Any], list[Any]], list[Any]]
_EVALUATORS: dict[str, Evaluator] = {}


def register_evaluator(name: str, fn: Evaluator) -> None:
    """Makes the interpreter evaluate primitive ``name`` as ``fn(params, ins)``."""
    _EVALUATORS[name] = fn


def evaluator(name: str) -> Evaluator | None:
    """The evaluator of primitive ``name``, or None (bind it as it is)."""
    return _EVALUATORS.get(name)
