"""Forward values made again from stored copies, instead of storing more.

An equation evaluated at point (:func:`.replays.at_point`) stores copies of
its rebuilt inputs: the forward values, exactly. Any value computed from such
copies (and from values the backward pass knows exactly) by a few cheap
equations has its forward value within reach too: ``jnp.floor_divide``
decides on ``x - rem(x, m)`` after ``rem``'s input ``x`` was stored. A
decision on such values is made from them exactly, and need not be stored.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from revnet._engine import jaxpr as jx
from revnet._engine.interpreter import evaluate_eqns

# How many equations are evaluated again, at most, to make one decision from
# stored copies instead of storing it too.
LIMIT = 32


def forward_values(
    atoms: Sequence[Any],
    rebuilt: Callable[[Any], bool],
    copies: Mapping[Any, Any],
    made: Mapping[Any, Any],
    source_info: Any,
) -> tuple[list, list] | None:
    """The forward values of ``atoms``, made again from stored copies.

    Args:
      atoms: the values wanted (an equation's inputs).
      rebuilt: whether a variable is a rebuilt float.
      copies: rebuilt variables to the stored copies of their forward values.
      made: each variable to the (rewritten) equation that makes it.
      source_info: what the new equations are attributed to.

    Returns:
      ``(equations, atoms)`` computing the forward values, or None when no
      atom is rebuilt, or a rebuilt one is not within :data:`LIMIT` cheap
      equations of stored copies and exact values.
    """
    chain: list = []
    leaves: dict = {}
    seen: set = set()

    def reach(a) -> bool:
        if jx.is_literal(a) or a in seen or a in leaves:
            return True
        if not rebuilt(a):
            leaves[a] = a
            return True
        if a in copies:
            leaves[a] = copies[a]
            return True
        e = made.get(a)
        if e is None or len(chain) >= LIMIT or not _cheap(e):
            return False
        seen.update(v for v in e.outvars if not jx.is_dropvar(v))
        if not all(reach(b) for b in e.invars):
            return False
        chain.append(e)
        return True

    if not any(rebuilt(a) for a in atoms) or not all(map(reach, atoms)):
        return None
    keys = list(leaves)

    def forward(*values):
        return evaluate_eqns(chain, dict(zip(keys, values)), atoms)

    eqns, outs = jx.splice(forward, [leaves[k] for k in keys], source_info)
    return eqns, [a if jx.is_literal(a) else o for a, o in zip(atoms, outs)]


def _cheap(e: Any) -> bool:
    """Whether ``e`` may be evaluated again to recompute a forward value: no
    body, no effects, and a few operations per result (no contraction).

    Contractions are excluded by name: recomputing a small one (a product
    over 4 terms, as cheap per result as a few elementwise operations) from
    stored copies leaves some programs unsolvable, for a reason not yet
    understood, so they are stored instead.
    """
    return (
        jx.call_body(e) is None
        and not e.effects
        and jx.primitive_name(e) not in ("dot_general", "conv_general_dilated")
    )
