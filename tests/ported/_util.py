"""Shared checks for the ported tests: trees compared leaf by leaf, dtypes too."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

import revnet
from tests.helpers import tolerance

# Relative tolerances for gradients rebuilt by inversion (DESIGN.md, "Tolerances").


def dtypes():
    """float32 and float64, each with the context it needs."""
    return [
        ("float32", contextlib.nullcontext),
        ("float64", lambda: jax.enable_x64(True)),
    ]


def assert_tree_allclose(
    actual,
    expected,
    rtol=1e-5,  # Equinox's tree_allclose defaults (numpy's allclose's)
    atol=1e-8,  # likewise
    dtype=True,
):
    """Same structure, shapes and (with ``dtype``) dtypes; values elementwise."""
    ta = jax.tree_util.tree_structure(actual)
    te = jax.tree_util.tree_structure(expected)
    assert ta == te, f"structures differ: {ta} vs {te}"
    for n, (a, e) in enumerate(
        zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected))
    ):
        assert np.shape(a) == np.shape(e), f"leaf {n}: {np.shape(a)} vs {np.shape(e)}"
        if dtype:
            da, de = jnp.result_type(a), jnp.result_type(e)
            assert da == de, f"leaf {n}: dtype {da} vs {de}"
        if jnp.result_type(e) == jax.dtypes.float0:
            continue
        np.testing.assert_allclose(
            np.asarray(a, np.float64),
            np.asarray(e, np.float64),
            rtol=rtol,
            atol=atol,
            err_msg=f"leaf {n}",
        )


def _loss(fun):
    # A loss whose cotangents differ from element to element and from output to
    # output, so that a swapped or misplaced cotangent shows.
    def loss(*args):
        leaves = jax.tree_util.tree_leaves(fun(*args))
        return sum(
            jnp.sum(
                jnp.sin(leaf * (k + 1.0))
                * jnp.arange(1, leaf.size + 1).reshape(leaf.shape).astype(leaf.dtype)
            )
            for k, leaf in enumerate(leaves)
        )

    return loss


def check_round_trip_and_grad(fun, *args, rtol=None):
    """``inverse(fun)(fun(x)) == x`` and ``grad(loss . invertible(fun)) ==
    grad(loss . fun)``, elementwise, for every positional argument."""
    rtol = (
        tolerance(jnp.result_type(jax.tree_util.tree_leaves(args)[0]), "ported")
        if rtol is None
        else rtol
    )
    out = fun(*args)
    back = revnet.inverse(fun, *args)(out)
    assert_tree_allclose(back, tuple(args), rtol=rtol, atol=rtol)
    argnums = tuple(range(len(args)))
    want = jax.grad(_loss(fun), argnums)(*args)
    got = jax.grad(_loss(revnet.invertible(fun)), argnums)(*args)
    assert_tree_allclose(got, want, rtol=rtol, atol=rtol)
    assert any(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree_util.tree_leaves(want))
