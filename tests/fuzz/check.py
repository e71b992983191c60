"""Checking one program against plain JAX: values, gradients, the inverse, and
refusal of the programs that lose information.
"""

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import revnet
from tests.fuzz.compare import Redraw, Wrong, compare, compare_to_reference
from tests.fuzz.evaluate import accepted_then, first_line, guard, value_and_grad
from tests.fuzz.families import EAGER_EVERY, FAMILIES, FORWARD_EVERY, FULL, HALF, PROBES
from tests.fuzz.programs import Program, build, materialise, tied
from tests.fuzz.static import check_static
from tests.helpers import tolerance


def check_program(prog: Program, invertible=revnet.invertible) -> tuple[str, str]:
    """Checks one program.

    Args:
      prog: the program.
      invertible: the decorator under test (swapped out by the checker's tests).

    Returns:
      ``(outcome, message)``: outcome ``"refused"`` or ``"accepted"`` when all is
      right, ``"wrong"`` for a mismatch or a wrong acceptance/refusal, or
      ``"error"`` (accepted or not) for any exception but a trace-time
      ``NotInvertibleError``; with the message.

    Raises:
      Redraw: when the program should be redrawn: its plain forward pass
        has huge intermediates, or it has a numerical mismatch and rebuilding
        its inputs is ill-conditioned at its precision (:func:`ill_conditioned`).
    """
    with jax.enable_x64(FAMILIES[prog.family][1]), warnings.catch_warnings():
        # Tiny programs: what a loop stores per step is meant to grow here.
        warnings.simplefilter("ignore", revnet.StoredGrowthWarning)
        if prog.mode == "static":
            outcome, message = check_static(prog, invertible)
        else:
            outcome, message = _check(prog, invertible)
    if outcome == "mismatch":
        if ill_conditioned(prog):
            raise Redraw(message)
        outcome = "wrong"
    return outcome, message


def ill_conditioned(prog: Program) -> bool:
    """Whether the program's inputs cannot be rebuilt at its precision.

    Evaluates the program in a higher precision (float64, or float32 for half
    precision programs), perturbs its outputs by two units of the program's own
    precision (``2 * finfo(dtype).eps``, relative, random signs, :data:`PROBES`
    times) and rebuilds the inputs with ``revnet.inverse``. If the rebuilt
    inputs move by more than a tenth of the program's tolerance (``x**9`` then
    ``+ 1`` loses ``x``), a mismatch at the program's precision is rounding,
    not a bug. Comparing two
    reconstructions, not a reconstruction with the inputs, keeps a wrong
    inverse from passing for an ill-conditioned one; any exception here means
    "not ill-conditioned". Programs with ties are probed on untied inputs (see
    :func:`materialise`): a decision at a tie flips under any nudge.
    """
    family = "f32" if prog.family in HALF else "f64"
    ref = dataclasses.replace(prog, family=family)
    eps = float(jnp.finfo(FAMILIES[prog.family][0]).eps)
    r = np.random.default_rng([prog.seed, prog.index, 11])
    try:
        with jax.enable_x64(FAMILIES[family][1]):
            f_plain, holder_plain = build(ref, plain=True)
            f_rev, holder = build(ref)
            # Away from ties: there a decision made again on the nudged outputs
            # flips by design, which says nothing about the conditioning.
            ws, a, b = materialise(ref, ties=False)
            holder["ws"] = holder_plain["ws"] = ws
            outs = f_plain(a, b)
            inv = revnet.inverse(f_rev, a, b)
            rebuilt = inv(outs)
            for _ in range(PROBES):
                signs = [r.choice([-2 * eps, 2 * eps], np.shape(y)) for y in outs]
                nudged = tuple(
                    y * (1 + jnp.asarray(e, y.dtype)) for y, e in zip(outs, signs)
                )
                tol = tolerance(prog.family, "fuzz") / 10
                compare(inv(nudged), rebuilt, tol, "sensitivity")
    except Wrong:
        return True
    except Exception:  # noqa: BLE001
        return False
    return False


def _storing_kinks(invertible):
    """``revnet.invertible`` (or a partial of it) with ``kinks="store"``, unless set."""
    if invertible is revnet.invertible:
        return functools.partial(revnet.invertible, kinks="store")
    if (
        isinstance(invertible, functools.partial)
        and invertible.func is revnet.invertible
        and "kinks" not in invertible.keywords
    ):
        return functools.partial(invertible, kinks="store")
    return invertible


def _check(prog: Program, invertible) -> tuple[str, str]:
    rtol = tolerance(prog.family, "fuzz")
    f_rev, holder = build(prog)
    f_plain, holder_plain = build(prog, plain=True)
    if tied(prog):
        invertible = _storing_kinks(invertible)
    rev = f_rev if prog.mode == "scan" else invertible(f_rev)
    ws, a, b = materialise(prog)
    holder["ws"] = holder_plain["ws"] = ws

    if prog.expect == "refuse":
        for stage, call in [
            ("trace", lambda: jax.eval_shape(rev, a, b)),
            ("inverse", lambda: revnet.inverse(f_rev, a, b)),
        ]:
            try:
                call()
            except revnet.NotInvertibleError:
                continue
            except Exception as e:  # noqa: BLE001
                return "error", f"{stage}: {type(e).__name__}: {first_line(e)}"
            return "wrong", f"{stage}: accepted a program that must be refused"
        return "refused", ""

    guard(prog, ws, a, b)
    for round_ in range(prog.rounds):
        if round_:
            ws, a, b = materialise(prog, round_)
            holder["ws"] = holder_plain["ws"] = ws
        stage = f"round {round_}: " if prog.rounds > 1 else ""
        # An eager call with concrete weights first (constants, not tracers),
        # for nested jits (whose weights change between the rounds) and for
        # every EAGER_EVERY-th program.
        eager = prog.rounds > 1 or prog.index % EAGER_EVERY == 0
        try:
            values = tuple(rev(a, b)) if eager else None
            (_, outs), grads = value_and_grad(rev, holder, ws, a, b)
        except revnet.NotInvertibleError as e:
            if round_ == 0:
                return (
                    "wrong",
                    f"refused a program that must be accepted: {first_line(e)}",
                )
            return accepted_then(e, stage + "grad")
        except Exception as e:  # noqa: BLE001
            return accepted_then(e, stage + "grad")
        try:
            (_, want_outs), want = value_and_grad(f_plain, holder_plain, ws, a, b)
            compare(outs, want_outs, rtol, stage + "values")
            if eager:
                compare(values, tuple(want_outs), rtol, stage + "eager values")
            compare(grads, want, rtol, stage + "grads (weights, a, b)")
            if prog.family in HALF:
                _check_half_reference(
                    prog, f_plain, holder_plain, ws, a, b, outs, grads, want_outs, want
                )
            if not tied(prog):
                # inverse() is given outputs only, so it makes decisions again
                # on rebuilt values; a near-tie there may flip.
                back = revnet.inverse(f_rev, a, b)(want_outs)
                compare(tuple(back), (a, b), rtol, stage + "inverse")
        except Exception as e:  # noqa: BLE001
            return accepted_then(e, stage.rstrip(": ") or "check")
    if prog.index % FORWARD_EVERY == 0 and prog.family in FULL:
        try:
            _check_forward_mode(
                rev,
                f_plain,
                holder,
                holder_plain,
                ws,
                a,
                b,
                rtol,
                _custom_rules(prog),
                prog.index,
            )
        except Exception as e:  # noqa: BLE001
            return accepted_then(e, "forward mode")
        finally:
            holder["ws"] = holder_plain["ws"] = ws
    return "accepted", ""


def _custom_rules(prog: Program) -> bool:
    """Whether the program calls a function with a custom derivative rule."""
    return any(
        op.construct in ("custom_jvp", "custom_vjp") or "custom" in op.variant
        for op in prog.ops
    )


def _check_forward_mode(
    rev, f_plain, holder, holder_plain, ws, a, b, rtol, custom, seed
):
    """Forward mode through the reversible call: ``jax.jvp`` and
    ``jax.linearize`` of it are refused in revnet's one line, and forward over
    reverse (a Hessian-vector product, as ``jax.hessian`` computes) equals
    plain JAX's.

    Forward over reverse may be refused, in the same line, where the call
    stores decisions. Not compared with ``custom`` rules: forward over
    reverse differentiates the rebuilt values by the primal's own derivative,
    which a custom rule (a straight-through estimator) need not be
    (``docs/limits.md``). The tangents are drawn from ``seed``."""
    for name, call in (
        ("jvp", lambda: jax.jvp(rev, (a, b), (a, b))),
        ("linearize", lambda: jax.linearize(rev, a, b)),
    ):
        try:
            call()
        except TypeError as e:
            if "forward mode" not in str(e) or "must implement" in str(e):
                raise Wrong(f"{name}: {type(e).__name__}: {first_line(e)}") from None
            continue
        raise Wrong(f"{name}: forward mode was not refused")
    if custom:
        return

    def grads(fun, held):
        return lambda *p: value_and_grad(fun, held, *p)[1]

    r = np.random.default_rng(seed)
    tangents = jax.tree_util.tree_map(
        lambda x: jnp.asarray(r.standard_normal(np.shape(x)), x.dtype), (ws, a, b)
    )
    try:
        got = jax.jvp(grads(rev, holder), (ws, a, b), tangents)[1]
    except TypeError as e:
        if "forward mode" in str(e) and "must implement" not in str(e):
            return  # refused in one line (a stored decision's own rule)
        raise
    want = jax.jvp(grads(f_plain, holder_plain), (ws, a, b), tangents)[1]
    compare(got, want, rtol, "forward over reverse (weights, a, b)")


def _check_half_reference(prog, f, holder, ws, a, b, outs, grads, want_outs, want):
    up = functools.partial(jax.tree_util.tree_map, lambda x: x.astype(jnp.float32))
    (_, ref_outs), ref = value_and_grad(f, holder, up(ws), up(a), up(b))
    holder["ws"] = ws
    tol = tolerance(prog.family, "fuzz")
    compare_to_reference(up(outs), up(want_outs), ref_outs, tol, "values vs float32")
    compare_to_reference(up(grads), up(want), ref, tol, "grads vs float32")
