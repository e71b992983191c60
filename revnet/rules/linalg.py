"""Linear algebra: ``dot_general`` with a known square matrix, solved; its
log-determinant term is the matrix's ``slogdet`` per row."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from revnet._engine import SINGULAR, SMOOTH, NotInvertibleError, define, refusal
from revnet.rules._solve import one_unknown, with_value


def dot_general(outs, ins, *, dimension_numbers, in_avals, **params):
    (y,) = outs
    i = one_unknown(ins)
    (lc, rc), (lb, rb) = dimension_numbers
    if lb or rb:
        raise NotInvertibleError("dot_general with batch dimensions is not supported")
    if len(lc) != 1:
        raise NotInvertibleError("dot_general must contract exactly one dimension")
    m = ins[1 - i]
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise NotInvertibleError(
            f"the known operand of dot_general must be a square matrix, got shape "
            f"{tuple(m.shape)}"
        )
    x_aval = in_avals[i]
    if not jnp.issubdtype(x_aval.dtype, jnp.inexact):
        raise NotInvertibleError("integer dot_general is not invertible")
    n = m.shape[0]
    cx = (lc if i == 0 else rc)[0]
    cm = (rc if i == 0 else lc)[0]
    if n == 0 or 0 in y.shape:  # nothing to solve for
        return with_value(ins, i, jnp.zeros(x_aval.shape, x_aval.dtype))
    # Solve in at least float32 (LAPACK has no half-precision solvers).
    solve_dtype = jnp.promote_types(y.dtype, jnp.float32)
    y = y.astype(solve_dtype)
    mat = m.astype(solve_dtype)
    # Bring the product to the form  Y[..., j] = sum_k X[..., k] A[k, j].
    a = mat if cm == 0 else mat.T
    if i == 0:  # y dims: x free dims..., m free dim
        y2 = y
    else:  # y dims: m free dim, x free dims...
        y2 = jnp.moveaxis(y, 0, -1)
    batch_shape = y2.shape[:-1]
    flat = y2.reshape((-1, n))
    # X A = Y  <=>  A^T X^T = Y^T.
    x_flat = jnp.linalg.solve(a.T, flat.T).T
    x_moved = x_flat.reshape((*batch_shape, n)).astype(x_aval.dtype)
    return with_value(ins, i, jnp.moveaxis(x_moved, -1, cx))


def dot_general_term(outs, ins, unknown, *, dimension_numbers, **params):
    """``slogdet`` of the known matrix, once for each row it multiplies.

    The term keeps the unknown's shape with its contracted axis of size 1: the
    value is computed once per call and broadcast, not once per row.
    """
    (lc, rc), _ = dimension_numbers
    x, m = ins[unknown], ins[1 - unknown]
    cx = (lc if unknown == 0 else rc)[0]
    solve_dtype = jnp.promote_types(m.dtype, jnp.float32)
    _, logabsdet = jnp.linalg.slogdet(m.astype(solve_dtype))
    shape = list(x.shape)
    shape[cx] = 1
    return jnp.broadcast_to(logabsdet.astype(x.dtype), shape)


def check_dot_general(statics, **params):
    for m in statics:
        if m is None:
            continue
        m = np.asarray(m, np.float64)
        if m.ndim == 2 and m.shape[0] == m.shape[1] and m.size:
            if np.linalg.matrix_rank(m) < m.shape[0]:
                raise refusal(
                    "the constant matrix of dot_general is singular", hint=SINGULAR
                )


# A product with a known square matrix: smooth; slogdet of the matrix per row.
define(
    "dot_general",
    inverse=dot_general,
    continuity=SMOOTH,
    check=check_dot_general,
    log_det=dot_general_term,
)
