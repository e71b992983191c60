"""Shape and layout: ``reshape``, ``transpose``, ``broadcast_in_dim`` adding unit
dimensions, ``rev``, ``concatenate``, ``split``."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from revnet._engine import SMOOTH, NotInvertibleError, define


def _reshape(outs, ins, *, in_avals, **params):
    return [jnp.reshape(outs[0], in_avals[0].shape)]


def _transpose(outs, ins, *, permutation, **params):
    return [lax.transpose(outs[0], tuple(np.argsort(permutation)))]


def _broadcast_in_dim(outs, ins, *, shape, in_avals, **params):
    a = in_avals[0]
    if int(np.prod(a.shape)) != int(np.prod(shape)):
        raise NotInvertibleError(
            f"broadcast from {tuple(a.shape)} to {tuple(shape)} copies values; only "
            "broadcasts that add unit dimensions are invertible"
        )
    return [jnp.reshape(outs[0], a.shape)]


def _rev(outs, ins, *, dimensions, **params):
    return [lax.rev(outs[0], dimensions)]


def _concatenate(outs, ins, *, dimension, in_avals, **params):
    (y,) = outs
    new, start = list(ins), 0
    for i in range(len(ins)):
        size = in_avals[i].shape[dimension]
        if ins[i] is None:
            new[i] = lax.slice_in_dim(y, start, start + size, axis=dimension)
        start += size
    return new


def _split(outs, ins, *, axis, **params):
    return [lax.concatenate(list(outs), axis)]


# Data movement: smooth, volume preserving.
define("reshape", inverse=_reshape, continuity=SMOOTH, log_det=0)
define("squeeze", inverse=_reshape, continuity=SMOOTH, log_det=0)
define("transpose", inverse=_transpose, continuity=SMOOTH, log_det=0)
define("broadcast_in_dim", inverse=_broadcast_in_dim, continuity=SMOOTH, log_det=0)
define("rev", inverse=_rev, continuity=SMOOTH, log_det=0)
define("concatenate", inverse=_concatenate, continuity=SMOOTH, log_det=0)
define("split", inverse=_split, continuity=SMOOTH, log_det=0)
