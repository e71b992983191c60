"""An inverse rule tried on abstract values before a plan relies on it.

The analysis (:mod:`.analysis`) and the structural rules that solve through a
primitive's rule (:mod:`.structural.select`) run :func:`abstract_solve` once
per equation: a rule that refuses, breaks on the shapes, or returns values of
the wrong type or sharding is reported at trace time, naming the equation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from revnet._engine import jaxpr as jx
from revnet._engine import sharded_types
from revnet._engine.errors import NotInvertibleError, RuleError


def abstract_solve(rule: Any, eqn: Any, ins: Sequence[bool], static_value) -> None:
    """Runs a primitive's inverse rule on abstract values to check that it applies.

    Known inputs whose value is fixed at trace time (``static_value(n)`` for
    input ``n``) are passed to the rule's check, so that it can refuse, for
    example, a multiplication by a constant zero.

    Raises:
      NotInvertibleError: when the rule refuses, fails on these shapes, or
        returns a value of the wrong type.
    """
    in_avals = [jx.aval(v) for v in eqn.invars]
    statics = [static_value(n) if k else None for n, k in enumerate(ins)]
    try:
        rule.run_check(statics, eqn.params, in_avals)
    except NotInvertibleError:
        raise
    except Exception as e:
        raise RuleError(f"its inverse rule's check raised {_describe(e)}") from e

    def go(outs, known):
        it = iter(known)
        with jx.context(eqn):
            return rule(
                outs, [next(it) if k else None for k in ins], eqn.params, in_avals
            )

    # The structs keep the avals' sharding types (Explicit axes, varying
    # manual axes): a rule's shape work must pass them through.
    outs = [jx.struct(jx.aval(v)) for v in eqn.outvars]
    known = [jx.struct(a) for a, k in zip(in_avals, ins) if k]
    try:
        result = jax.eval_shape(go, outs, known)
    except NotInvertibleError:
        raise
    except Exception as e:  # a rule that cannot trace on these shapes
        raise RuleError(f"its inverse rule raised {_describe(e)}") from e
    if not isinstance(result, (list, tuple)) or len(result) != len(ins):
        raise RuleError(
            f"its inverse rule returned {type(result).__name__}"
            f"{f' of {len(result)}' if isinstance(result, (list, tuple)) else ''}"
            f", not a list of the equation's {len(ins)} inputs"
        )
    for a, k, r in zip(in_avals, ins, result):
        if not k and (
            not hasattr(r, "shape")
            or tuple(r.shape) != tuple(a.shape)
            or r.dtype != a.dtype
        ):
            got = f"{r.dtype}{list(r.shape)}" if hasattr(r, "shape") else repr(r)
            raise RuleError(
                f"its inverse rule returned {got} for an input of type "
                f"{a.dtype}{list(a.shape)}"
            )
        if not k and sharded_types.type_key(r) != sharded_types.type_key(a):
            raise RuleError(
                f"its inverse rule returned a value of sharding "
                f"{sharded_types.describe(r)} for an input of sharding "
                f"{sharded_types.describe(a)}"
            )


def _describe(e: Exception) -> str:
    """``Type: message`` of an exception, on one line."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
