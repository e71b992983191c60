"""Comparing revnet's trees with plain JAX's, and the two ways a check ends
early: :class:`Wrong` and :class:`Redraw`.
"""

import jax
import jax.numpy as jnp
import numpy as np

from tests.helpers import assert_trees_close


class Wrong(AssertionError):
    """A program that revnet got wrong (not a numerical nuisance)."""


class Redraw(Exception):
    """The program must be redrawn: it is ill-conditioned, or says nothing."""


def all_zero(tree) -> bool:
    leaves = [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(tree)]
    return all(not np.any(x) for x in leaves)


def compare(actual, expected, rtol: float, what: str):
    """``assert_trees_close`` plus dtypes, and exact equality for all-zero trees.

    Args:
      actual: the tree revnet computed.
      expected: the tree plain JAX computed.
      rtol: relative tolerance.
      what: names the compared tree in the message.
    """
    sa = jax.tree_util.tree_structure(actual)
    se = jax.tree_util.tree_structure(expected)
    if sa != se:
        raise Wrong(f"{what}: tree structures differ: {sa} vs {se}")
    for n, (x, y) in enumerate(
        zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected))
    ):
        if jnp.result_type(x) != jnp.result_type(y) or np.shape(x) != np.shape(y):
            raise Wrong(
                f"{what} leaf {n}: {jnp.result_type(x)}{list(np.shape(x))} vs "
                f"{jnp.result_type(y)}{list(np.shape(y))}"
            )
        xe, ye = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if not np.array_equal(np.isfinite(xe), np.isfinite(ye)):
            raise Wrong(f"{what} leaf {n}: non-finite values where plain JAX has none")
    try:
        if all_zero(expected):
            for x, y in zip(
                jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected)
            ):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y), what)
        else:
            assert_trees_close(actual, expected, rtol, what)
    except AssertionError as e:
        raise Wrong(" ".join(str(e).split())) from None


def compare_to_reference(actual, plain, reference, rtol: float, what: str):
    """Half precision against a float32 reference: ``err <= 3 err_plain + tol``.

    Args:
      actual: revnet's tree, in half precision.
      plain: plain JAX's tree, in the same dtype.
      reference: plain JAX's tree computed in float32.
      rtol: tolerance relative to the largest reference value of each leaf (at
        least a tenth of the tree's largest).
      what: names the compared tree in the message.
    """
    trees = [jax.tree_util.tree_leaves(t) for t in (actual, plain, reference)]
    leaves = [[np.asarray(v, np.float64) for v in t] for t in trees]
    ref_max = max([float(np.max(np.abs(r))) for r in leaves[2] if r.size] + [0.0])
    for n, (x, p, r) in enumerate(zip(*leaves)):
        if not r.size:
            continue
        scale = max(float(np.max(np.abs(r))), 0.1 * ref_max)
        err, err_plain = np.max(np.abs(x - r)), np.max(np.abs(p - r))
        if not err <= 3 * err_plain + rtol * scale:
            raise Wrong(
                f"{what} leaf {n}: error {err:.3g} against float32, plain JAX in the "
                f"same dtype {err_plain:.3g} (scale {scale:.3g})"
            )
