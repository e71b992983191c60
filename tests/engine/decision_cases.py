"""Decision and kink cases on inputs with exact ties.

Each case is the F of an additive coupling stack, ``a = a + F(b @ wf, p) / 2``,
``b = b + F(a @ wg, p) / 2``, scanned over stacked per-layer weights with
``lax.scan`` inside one function (``stack``), the shape of
``benchmarks/decisions.py``. The weights are eighths and the inputs halves, so
that ``b @ wf`` in the first layer is a multiple of 1/16, exactly, and meets
the thresholds, bucket edges, modulus multiples, rounding midpoints and equal
maxima below. The F's are smooth elsewhere (``tanh``, ``sin``), so that the
values the backward pass rebuilds differ from the forward ones by rounding:
a decision made again on rebuilt values flips at those ties. Each F's
derivative, or the parameter it gathers, depends on the side of the tie, so
that a flip shows in the gradient, not only in the rebuilt first input.

``DECISIONS`` holds the jumps: their gradients
must equal ``jax.grad`` under the default options. ``KINKS`` holds the
continuous functions whose derivative jumps: under ``kinks="store"`` they must
differentiate at the ties as ``jax.grad`` does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

WIDTH, BATCH, DEPTH = 8, 64, 16
W_RANGE = 2  # coupling weights: integers in [-W_RANGE, W_RANGE], over 8
SCALE = 0.5  # F's value is halved before it is added: a well-conditioned stack
CENTROIDS, BUCKETS = 4, 9
# Bucket edges, thresholds and moduli: multiples of 1/4, all met by b @ wf.
EDGES = np.linspace(-1.0, 1.0, BUCKETS)


class Case(NamedTuple):
    """``f(h, p)``: F's value at the pre-activation ``h = stream @ w`` for the
    layer's parameters ``p``; ``uses``: the extra per-layer parameters it
    reads (besides ``f`` and ``g``, the coupling weights)."""

    f: Callable
    uses: tuple[str, ...] = ()


def _smooth(h):
    return 0.5 * jnp.tanh(h)


# -- the jumps ---------------------------------------------------------------- #


def _step(h):
    """A select on a comparison whose cases differ in value and slope at the
    threshold: a flip changes the value and the derivative."""
    return jnp.where(h > 0, 0.5 + jnp.tanh(h), 0.25 * h - 0.25)


def _checkpointed(h, p):
    return jax.checkpoint(_step)(h)


def _in_scan(h, p):
    """Thresholds applied one per step of a ``lax.scan`` in F."""

    def body(acc, t):
        return acc + jnp.where(h > t, 0.25 + jnp.tanh(h - t), 0.25 * (h - t)), None

    thresholds = jnp.asarray([-0.25, 0.0, 0.25], h.dtype)
    return lax.scan(body, jnp.zeros_like(h), thresholds)[0] / 3


def _kmeans(h, p):
    """k-means routing (Routing Transformers): three static iterations of a
    ``fori_loop``, each moving every row toward its nearest centroid. The
    centroids have equal norms, so equal dot products are equal distances."""
    c = p["centroids"]

    def body(i, z):
        d = jnp.sum((z[:, None, :] - c[None]) ** 2, -1)
        return z + 0.25 * (c[jnp.argmin(d, -1)] - z)

    return jnp.tanh(lax.fori_loop(0, 3, body, h))


def _bucket(method):
    """A learned embedding gathered by bucket index (``searchsorted``)."""

    def f(h, p):
        edges = jnp.asarray(EDGES, h.dtype)
        return p["emb"][jnp.searchsorted(edges, h, method=method)] + _smooth(h)

    return f


def _digitize(h, p):
    return p["emb"][jnp.digitize(h, jnp.asarray(EDGES, h.dtype))] + _smooth(h)


# Sawtooth features: the slope of ``sin`` differs at the two ends of a tooth.


def _mod(h, p):
    return jnp.sin(3 * jnp.mod(h, 0.5))


def _percent(h, p):
    return jnp.sin(3 * (h % 0.5))


def _fmod(h, p):
    return jnp.sin(3 * jnp.fmod(h, 0.5))


def _approx_max_k(h, p):
    """Top-2 gating by ``approx_max_k`` on router logits (equal logits tie);
    its indices scatter the softmax gates."""
    vals, idx = lax.approx_max_k(h @ p["router"], 2)
    gates = jax.nn.softmax(vals, -1)[..., None]
    mask = jnp.sum(jax.nn.one_hot(idx, WIDTH, dtype=h.dtype) * gates, -2)
    return mask * jnp.tanh(h)


def _fp8(h, p):
    """FP8 (e4m3) fake quantisation with a zero point of -1: ``h + 1`` in
    ``[1, 2)`` on odd sixteenths is half-way between two e4m3 values."""
    q = lax.reduce_precision(h + 1, exponent_bits=4, mantissa_bits=3) - 1
    return jnp.sin(2 * q)


def _bf16(h, p):
    """A float32 -> bfloat16 -> float32 round trip (quantisation-aware
    training); ``h * (1 + 2**-8)`` sits exactly half-way between two bfloat16
    values wherever ``h`` is a power of two."""
    q = (h * (1 + 2.0**-8)).astype(jnp.bfloat16).astype(h.dtype)
    return jnp.sin(8 * q) / 4


def _other(h):
    return jnp.where(h < 0, 0.25 - jnp.tanh(h), 0.75 * h - 0.5)


def _cond_known(h, p):
    """``lax.cond`` on a per-layer weight (known); its branches compare ``h``."""
    return lax.cond(p["gate"] > 0, _step, _other, h)


def _cond_rebuilt(h, p):
    """``lax.cond`` on the sum of ``h`` (rebuilt: exactly 0 in the first layer
    for the antisymmetric batch of ``inputs``); its branches compare ``h``."""
    return lax.cond(jnp.sum(h) >= 0, _step, _other, h)


@jax.custom_jvp
def _custom_step(h):
    return _step(h)


@_custom_step.defjvp
def _custom_step_jvp(primals, tangents):
    (h,), (t,) = primals, tangents
    slope = jnp.where(h > 0, 1 - jnp.tanh(h) ** 2, 0.25)
    return _custom_step(h), slope * t


def _custom_jvp(h, p):
    return _custom_step(h)


DECISIONS: dict[str, Case] = {
    "checkpoint": Case(_checkpointed),
    "scan in F": Case(_in_scan),
    "fori_loop k-means": Case(_kmeans, ("centroids",)),
    "searchsorted scan": Case(_bucket("scan"), ("emb",)),
    "searchsorted scan_unrolled": Case(_bucket("scan_unrolled"), ("emb",)),
    "searchsorted compare_all": Case(_bucket("compare_all"), ("emb",)),
    "searchsorted sort": Case(_bucket("sort"), ("emb",)),
    "digitize": Case(_digitize, ("emb",)),
    "jnp.mod": Case(_mod),
    "% 0.5": Case(_percent),
    "jnp.fmod": Case(_fmod),
    "approx_max_k": Case(_approx_max_k, ("router",)),
    "reduce_precision e4m3": Case(_fp8),
    "bfloat16 round trip": Case(_bf16),
    "cond, known index": Case(_cond_known, ("gate",)),
    "cond, rebuilt index": Case(_cond_rebuilt),
    "custom_jvp": Case(_custom_jvp),
}


# -- the kinks ---------------------------------------------------------------- #


def _kink(fn):
    return Case(lambda h, p: fn(h) + _smooth(h))


def _max_pool(h):
    return lax.reduce_window(h, -jnp.inf, lax.max, (1, 2), (1, 1), "SAME")


KINKS: dict[str, Case] = {
    "reduce_max": _kink(lambda h: 0.5 * jnp.max(h, -1, keepdims=True)),
    "reduce_min": _kink(lambda h: 0.5 * jnp.min(h, -1, keepdims=True)),
    "max pooling": _kink(lambda h: 0.5 * _max_pool(h)),
    "lax.clamp": _kink(lambda h: lax.clamp(jnp.asarray(-0.25, h.dtype), h, 0.25)),
    "cummax": _kink(lambda h: 0.5 * lax.cummax(h, 1)),
    "cummin": _kink(lambda h: 0.5 * lax.cummin(h, 1)),
    "relu6": _kink(lambda h: jax.nn.relu6(8 * h) / 8),
    "hard_sigmoid": _kink(lambda h: jax.nn.hard_sigmoid(8 * h)),
    "hard_swish": _kink(lambda h: jax.nn.hard_swish(8 * h) / 8),
    "jnp.clip": _kink(lambda h: jnp.clip(h, -0.25, 0.25)),
    "jnp.maximum": _kink(lambda h: jnp.maximum(h, 0.25)),
    "abs": _kink(lambda h: 0.5 * jnp.abs(h)),
    "relu": _kink(jax.nn.relu),
}

CASES: dict[str, Case] = {**DECISIONS, **KINKS}

# The F of a ``revnet.scan`` nested in ``@revnet.invertible``: a plain select.
NESTED = Case(lambda h, p: _step(h))


# -- the harness --------------------------------------------------------------- #


def params(case: Case, depth: int = DEPTH, dtype=jnp.float32, seed: int = 0):
    """Per-layer weights, stacked on a leading ``depth`` axis: coupling
    weights in eighths in ``[-1/4, 1/4]`` (exact products, and gradients
    within 1e4 at depth 16), centroids ``±e_k / 2`` (equal norms), bucket
    embeddings and router weights in eighths in ``[-1/2, 1/2]`` (equal
    logits), and cond gates of either sign."""
    rng = np.random.default_rng(seed)

    def eighths(*shape):
        return rng.integers(-4, 5, (depth, *shape)) / 8

    def coupling():
        return rng.integers(-W_RANGE, W_RANGE + 1, (depth, WIDTH, WIDTH)) / 8

    out = {"f": coupling(), "g": coupling()}
    if "centroids" in case.uses:
        signs = rng.choice([-1.0, 1.0], (depth, CENTROIDS, 1))
        out["centroids"] = 0.5 * signs * np.eye(CENTROIDS, WIDTH)
    if "emb" in case.uses:
        out["emb"] = eighths(BUCKETS + 1)
    if "router" in case.uses:
        out["router"] = eighths(WIDTH, WIDTH)
    if "gate" in case.uses:
        out["gate"] = rng.choice([-1.0, 1.0], depth)
    return {k: jnp.asarray(v, dtype) for k, v in out.items()}


def inputs(dtype=jnp.float32, seed: int = 1, batch: int = BATCH):
    """Two streams of halves in ``[-1, 1]``, the second half of the batch the
    negative of the first (so ``b @ wf`` sums to 0 exactly): zeros, equal
    entries and ties everywhere in the first layer."""
    rng = np.random.default_rng(seed)
    half = rng.integers(-2, 3, (2, batch // 2, WIDTH)) / 2
    a, b = np.concatenate([half, -half], 1)
    return jnp.asarray(a, dtype), jnp.asarray(b, dtype)


def stack(case: Case, ps: dict, scan: Callable = lax.scan):
    """``f(a, b)``: two additive couplings per layer, scanned over ``ps`` by
    ``scan`` (``lax.scan``; ``revnet.scan`` for revnet's own loop nested in
    ``@revnet.invertible``)."""

    def layer(carry, p):
        a, b = carry
        a = a + SCALE * case.f(b @ p["f"], p)
        b = b + SCALE * case.f(a @ p["g"], p)
        return (a, b), None

    def f(a, b):
        return scan(layer, (a, b), ps)[0]

    return f


def loss_fn(case: Case, wrap: Callable | None = None, scan: Callable = lax.scan):
    """``loss(params, a, b)``; ``wrap`` (e.g. ``revnet.invertible``) the stack."""

    def loss(ps, a, b):
        f = stack(case, ps, scan)
        outs = (wrap(f) if wrap else f)(a, b)
        return sum(jnp.sum(jnp.sin(o) * (1.0 + o)) for o in outs)

    return loss


def grads(case: Case, wrap=None, dtype=jnp.float32, scan=lax.scan):
    """The gradient of ``loss_fn`` for every parameter leaf and both inputs,
    at depth ``DEPTH`` on the tied ``inputs``."""
    ps, (a, b) = params(case, DEPTH, dtype), inputs(dtype)
    return jax.jit(jax.grad(loss_fn(case, wrap, scan), (0, 1, 2)))(ps, a, b)


def leaf_errors(got, want) -> list[float]:
    """Per leaf: max |got - want| / max |want| (absolute where ``want`` is 0)."""
    out = []
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        scale = float(np.max(np.abs(w)))
        err = float(np.max(np.abs(g - w))) / (scale if scale > 0 else 1.0)
        out.append(err if np.isfinite(err) else float("inf"))
    return out
