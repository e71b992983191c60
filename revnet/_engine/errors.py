"""NotInvertibleError, and the wording of every refusal of the analysis.

The analysis records a :class:`Failure` per equation it could not solve and,
when it gives up, raises :class:`Stuck`; a front-end turns that into one
:class:`NotInvertibleError` with :func:`not_invertible`, naming the primitive,
the reason, the user's source line and the inputs that could not be rebuilt,
and, for the common shapes of refusal (:data:`HINTS`), a second line starting
with ``try:`` that names the remedy. A failure carries the kind of its hint:
the analysis sets it for a residual and for a primitive in
:data:`ON_STREAM_PRIMITIVES`; a rule sets it by raising :func:`refusal`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from revnet._engine import jaxpr as jx


class NotInvertibleError(ValueError):
    """Raised when a function cannot be inverted equation by equation.

    The message names the primitive, the input that could not be recovered and,
    where known, the user's source line.
    """


class RuleError(NotInvertibleError):
    """A rule that failed to run (raised, or returned a value of the wrong type)."""


# How much a failure explains, most first: a rule that broke; a refusal; an
# equation stuck only for want of known values (several unknown operands),
# which is usually a consequence of another failure.
BROKEN, REFUSED, WAITING = 0, 1, 2

# The kinds of hint, and the one line each adds to an error. A coupling updates
# one half of the stream from a function of the other, known, half; functions
# that lose information belong there.
RESIDUAL, ON_STREAM, CAST, SINGULAR = "residual", "on_stream", "cast", "singular"
WRAP, STATISTIC = "wrap", "statistic"
_COUPLING = "y1 = x1 + f(x2); y2 = x2 + g(y1)"
HINTS = {
    RESIDUAL: (
        "try: split the stream into halves and update each from the other, "
        f"{_COUPLING}, as revnet.blocks.AdditiveCoupling (or AffineCoupling, to "
        "also scale) does"
    ),
    ON_STREAM: (
        "try: use it only inside a coupling's F or G, on the other half of the "
        f"stream ({_COUPLING}, as in revnet.blocks.AdditiveCoupling), not on the "
        "stream itself"
    ),
    CAST: (
        "try: keep the stream in its floating dtype and cast inside a coupling's "
        "F or G (revnet.blocks.AdditiveCoupling's compute_dtype= does)"
    ),
    WRAP: (
        "try: carry unwrapped coordinates (add the displacement without the "
        "periodic wrap, as jax_md.space.free()'s shift does) and wrap them only "
        "where they are read, in displacements and energies: a wrapped "
        "coordinate no longer says how many periods it crossed"
    ),
    STATISTIC: (
        "try: normalise inside a coupling's F or G (a BatchNorm or LayerNorm "
        "there), or use an ActNorm on the stream (revnet.blocks.ActNorm, "
        "revnet.nnx.ActNorm or revnet.eqx.ActNorm: a learned per-channel scale "
        "and shift, which inverts)"
    ),
    SINGULAR: (
        "try: use an invertible matrix (identity- or orthogonal-initialised, or "
        "LU-parametrised), or apply the layer inside a coupling's F or G"
    ),
}

# Primitives without an inverse that lose information on the stream (a
# reduction, a kink); the hint is to use them inside F or G.
ON_STREAM_PRIMITIVES = frozenset(
    {
        "reduce_sum",
        "reduce_max",
        "reduce_min",
        "reduce_prod",
        "argmax",
        "argmin",
        "max",
        "min",
        "abs",
        "clamp",
    }
)

# Primitives that wrap a value into a period (a periodic boundary).
WRAP_PRIMITIVES = frozenset({"rem"})

# Binary primitives whose operands, both depending on one unknown value, make a
# residual ``x + f(x)`` (or ``x * f(x)``).
RESIDUAL_PRIMITIVES = frozenset({"add", "add_any", "sub", "mul", "div"})
# Reductions: a statistic of the stream (a normalisation's mean or variance)
# that the normalised output does not give back.
STATISTIC_PRIMITIVES = frozenset(
    {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "psum", "pmean"}
)


@dataclasses.dataclass
class Failure:
    """Why one equation could not be solved (``inner``: inside its body).

    ``rank`` is one of :data:`BROKEN`, :data:`REFUSED`, :data:`WAITING`;
    ``hint`` is None or a key of :data:`HINTS`. ``waits_for`` lists the
    unknown values (by wiring position) without which the equation cannot be
    solved although it would be with them: a slice whose sibling slices would
    cover its operand, an equation with an output still unknown. The equations
    that fail to rebuild them explain this failure, and are reported instead.
    It may be a function giving that list, for a check that only a refusal
    needs (see :meth:`waiting`).
    """

    eqn: Any
    reason: str
    where: str
    inner: Failure | None = None
    rank: int = REFUSED
    hint: str | None = None
    waits_for: Sequence[int] | Callable[[], Sequence[int]] = ()

    def waiting(self) -> tuple[int, ...]:
        """``waits_for``, computed once if it is a function."""
        if callable(self.waits_for):
            self.waits_for = tuple(self.waits_for())
        return tuple(self.waits_for)

    def severity(self) -> int:
        """The rank of the deepest failure: the one that is reported."""
        return self.deepest().rank

    def deepest(self) -> Failure:
        """The innermost failure: the one that is reported."""
        f = self
        while f.inner is not None:
            f = f.inner
        return f

    def describe(self) -> tuple[str, str, str]:
        """``(primitive text, reason, source line)`` of the deepest failure."""
        name = jx.primitive_name(self.eqn)
        if self.inner is None:
            return f"`{name}`", self.reason, self.where
        # The innermost level with a user line: the innermost equation itself
        # is often library code (the ``max`` inside ``jax.nn.relu``), while the
        # call around it carries the user's line.
        deepest, where = self, self.where
        while deepest.inner is not None:
            deepest = deepest.inner
            where = deepest.where or where
        text = f"`{jx.primitive_name(deepest.eqn)}` inside `{name}`"
        if jx.call_name(self.eqn):
            text += f" ({jx.call_name(self.eqn)})"
        return text, deepest.reason, where


class Stuck(Exception):
    """The analysis made no progress: ``unknown`` inputs cannot be rebuilt.

    ``by_decisions`` is set when the program itself can be inverted, and is
    stuck only with its stored decisions exposed."""

    def __init__(self, failure: Failure | None, unknown: Sequence[int]):
        super().__init__("stuck")
        self.failure = failure
        self.unknown = list(unknown)
        self.by_decisions = False


def refusal(reason: str, *, hint: str) -> NotInvertibleError:
    """A rule's refusal whose error ends with the hint ``HINTS[hint]``."""
    if hint not in HINTS:
        raise ValueError(f"unknown hint {hint!r}; expected one of {sorted(HINTS)}")
    error = NotInvertibleError(reason)
    error.hint = hint
    return error


def hint_of(error: NotInvertibleError) -> str | None:
    """The kind of hint a rule's refusal carries (see :func:`refusal`), or None."""
    return getattr(error, "hint", None)


# Why a call that is not differentiated is refused: the analysis runs when the
# function is traced, so that a block that cannot be inverted fails at once.
_WHEN = (
    "; this is checked when a call is traced, before any gradient, so that it "
    "fails at the first call"
)


def not_invertible(
    stuck: Stuck,
    in_paths: Sequence[str],
    n_consts: int,
    fname: str,
    *,
    traced: bool = True,
    lost: Sequence[int] = (),
) -> NotInvertibleError:
    """The user-facing error for ``stuck``.

    Args:
      stuck: the analysis' refusal.
      in_paths: a name for each argument leaf (``args[0]['w']``).
      n_consts: how many leading jaxpr inputs are closed-over constants.
      fname: the user's function name.
      traced: whether the refusal comes from tracing a call of ``fname`` (the
        message then says why a call that is not differentiated is refused);
        False for :func:`revnet.inverse`.
      lost: the inputs (positions, as ``stuck.unknown``) a loop's step
        overwrites: given them, the rest inverts. The hint then names them.

    Returns:
      The error: one line naming the equation, the reason, the source line and
      the inputs that cannot be recovered, then, for a common shape of refusal,
      one line starting with ``try:``.
    """

    def describe(n: int) -> str:
        k = n - n_consts
        return f"input {in_paths[k]}" if 0 <= k < len(in_paths) else f"input {k}"

    names = ", ".join(describe(n) for n in stuck.unknown)
    when = _WHEN if traced else ""
    f = stuck.failure
    if f is None:
        return NotInvertibleError(
            f"{fname} is not invertible: {names} could not be recovered from the "
            "outputs (it does not reach the outputs through invertible equations)"
            f"{when}"
        )
    prim, reason, where = f.describe()
    where = where or jx.caller_site()
    loc = f" at {where}" if where else ""
    library = jx.library_where(f.deepest().eqn)
    if library and library != where:  # made inside an installed package
        loc = f" at {library}" + (f", called from {where}" if where else "")
    hint = f.deepest().hint
    text = HINTS[hint] if hint is not None else ""
    if lost and hint is None:
        leaves = ", ".join(describe(n) for n in lost)
        text = (
            f"try: the step overwrites {leaves} (no output determines its old "
            "value, and its new value reads the old carry); compute it from the "
            "other leaves at the start of the step instead of carrying it (a force "
            "from the positions, before the first momentum update), or from the "
            "step's new values only (revnet rebuilds such a leaf by the step "
            "before), and the step inverts; or pass mode='auto', which stores it "
            "at every step"
        )
    return NotInvertibleError(
        f"{fname} is not invertible: cannot solve {prim}{loc} ({reason}), so "
        f"{names} could not be recovered{when}" + (f"\n{text}" if text else "")
    )


# What each kind of stored value is called, and the option that recomputes it.
_RECOMPUTE = {
    "kink": (
        "a kink",
        "kinks='recompute' (a recomputed kink's derivative at a tie follows the "
        "rebuilt value)",
    ),
    "decision": (
        "a decision",
        "decisions='recompute' (a recomputed decision may flip near a tie)",
    ),
}


def cannot_store(
    reason: str, label: str, where: str, within: str, fix: str, loop: str = ""
) -> ValueError:
    """The one-line ValueError for a value that must be stored and cannot be.

    Args:
      reason: why it is stored: ``"kink"`` (``kinks="store"``), or anything
        else for a decision (:class:`revnet._engine.decisions.Kept`'s reason).
      label: the equation that makes it (``"`lt`"``, ``"`custom_jvp_call`
        (relu)"``).
      where: that equation's source line, or ``""``.
      within: where it sits (``"inside a while_loop body"``).
      fix: why it cannot be stored there and what to do instead.
      loop: the front end refusing it (``"while_loop"``), or ``""``.

    Returns:
      ``ValueError("a kink (`max` at f.py:3 (body)) inside ...; or pass
      kinks='recompute' (...)")``: the option that recomputes it comes last.
    """
    noun, option = _RECOMPUTE.get(reason, _RECOMPUTE["decision"])
    at = f" at {where}" if where else ""
    head = f"{loop}: " if loop else ""
    return ValueError(
        f"{head}{noun} ({label}{at}) {within} reads values the backward pass "
        f"rebuilds, and {fix}; or pass {option}"
    )


def reverse_mode_only(name: str, run: Callable[..., Any], *args: Any) -> Any:
    """``run(*args)``, naming ``name`` (``revnet.scan``) in one line when
    forward-mode differentiation reaches it: its VJP is custom, as every
    ``jax.custom_vjp`` function's, and JAX's own message names neither the
    function nor what works."""
    try:
        return run(*args)
    except TypeError as e:
        if "forward-mode" not in str(e):
            raise
        raise TypeError(
            f"{name} is differentiable in reverse mode only (jax.grad, jax.vjp, "
            "jax.jacrev, and jax.hessian, which is forward-over-reverse); forward "
            "mode (jax.jvp, jax.jacfwd, jax.linearize) was applied to it, or "
            "forward over reverse reached a jax.custom_vjp function inside it (a "
            "stored decision's, or one of your own, which plain JAX refuses too)"
        ) from None


def leaf_paths(prefix: str, tree: Any) -> list[str]:
    """``prefix`` plus each leaf's path (``args[0]['w']``), for error messages."""
    paths, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [prefix + jax.tree_util.keystr(p) for p, _ in paths]


def show(value: Any) -> str:
    """A one-line, bounded ``repr`` of ``value`` for an error message."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 80 else text[:77] + "..."


# Why an inverse gave a non-finite value, where its primitive says it: the
# inverse of ``dot_general`` solves with its known matrix, and that of
# ``gather`` marks the elements its indices do not read exactly once.
_DEGENERATE = {
    "dot_general": (
        ": its known matrix is singular (or nearly), so these values cannot be "
        f"rebuilt\n{HINTS[SINGULAR]}"
    ),
    "gather": (
        ": its indices read some elements more than once and others never (not a "
        "permutation), so those values cannot be rebuilt; permute with indices "
        "that read each element once, or use ordinary backprop for this part"
    ),
}


def degenerate(eqn: Any) -> str:
    """The run-time message for an inverse that gave a non-finite value.

    A non-finite value from ``dot_general``'s inverse means its known matrix is
    singular (a weight, or a value computed at run time, that the analysis
    could not see), and from ``gather``'s that its indices are not a
    permutation: the message says so.
    """
    where = jx.where(eqn)
    name = jx.primitive_name(eqn)
    at = f" at {where}" if where else ""
    why = _DEGENERATE.get(
        name,
        " (a zero factor, a singular matrix, a saturated tanh/logistic, a dropout "
        "mask on the stream, or a damping factor of modulus below 1 divided by at "
        "every reversed step until the values overflow): these values cannot be "
        "rebuilt; use ordinary backprop for this part (mode='checkpoint' in a "
        "loop), anchors, or exact mode",
    )
    return (
        f"the inverse of `{name}`{at} gave a non-finite value from finite values{why}"
    )
