"""Random flows: ``revnet.forward_and_log_det`` against ``slogdet(jacfwd)``.

Each program is a chain of 1 to 6 random layers on a float64 stream of shape
``(2, 4)``, with random known weights: elementwise bijections in stable and
naive forms, ``softplus`` and ``logaddexp`` with a known operand, logit in its
three forms, factors and matrices, couplings (additive and affine), layout ops
(``roll``, a permutation by index), RealNVP with a binary mask (both
forms), ``cumsum``, ``jnp.where`` with two
bijections, a ``scan`` over layers (one with a leaky ReLU in its body: a
decision stored per step), a ``checkpoint`` and a ``jit``. Half the programs
ask for one log-determinant per example (``batch_ndim=1``) and are compared
with one ``slogdet(jacfwd)`` per example. revnet's side runs eagerly; the
reference is each layer's ``slogdet(jacfwd)`` at its input, summed (a chain's
Jacobian is the product of its layers'), compiled once per layer: no
compilation per program.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import revnet
from tests.helpers import tolerance

BATCH, WIDTH = 2, 4
# The reference is a sum of per-layer log-determinants, each to RTOL of its own
# size: the derived one must match it to RTOL of the sum of their sizes (layers
# can cancel), and to ATOL where every layer's is zero.
RTOL = tolerance("float64", "log_det")
ATOL = tolerance("float64", "log_det_floor")  # where every layer's is zero


def _coupling(w, h, affine):
    a, b = jnp.split(h, 2, -1)
    s = jnp.tanh(a @ w[:2, :2])
    b = b * jnp.exp(s) + s if affine else b + jnp.sin(a @ w[:2, :2])
    return jnp.concatenate([b, a], -1)


def _affine(w, h):
    return _coupling(w, h, True)


def _scan_step(h, w):
    return _affine(w, h)[:, ::-1], None


def _leaky_scan_step(h, w):
    """A step that stores a decision: per example, a scan output of shape
    ``[steps, batch, width]``."""
    return jax.nn.leaky_relu(_affine(w, h), 0.3)[:, ::-1], None


# Module-level functions, so that eager calls hit JAX's caches.
_checkpointed = jax.checkpoint(_affine)
_jitted = jax.jit(lambda h: jnp.sinh(h) * 2.0)


PERMUTATION = np.array([2, 0, 3, 1])


def _squashed(h):
    """``h`` mapped into (0.05, 0.95), as logit preprocessing expects."""
    return 0.05 + 0.9 * jax.nn.sigmoid(h)


MASK = np.array([1.0, 0.0, 0.0, 1.0])


def _masked(w, h, where):
    """RealNVP with a binary mask: ``h * m + (1 - m) * (...)``, or with
    ``jnp.where`` on the mask as a boolean."""
    if where:
        m = MASK > 0
        hm = jnp.where(m, h, 0.0)
    else:
        hm = h * MASK
    s = jnp.tanh(hm @ w)
    if where:
        return jnp.where(m, h, h * jnp.exp(s) + jnp.sin(hm @ w.T))
    return h * MASK + (1 - MASK) * (h * jnp.exp(s) + jnp.sin(hm @ w.T))


def _select(h):
    return jnp.where(h > 0.1, jnp.exp(h) - 1.0, 2.0 * h + (np.exp(0.1) - 1.2))


# name -> layer(w, h): w a (4, 4) weight, h the (2, 4) stream.
LAYERS = {
    "sinh": lambda w, h: jnp.sinh(h),
    "asinh": lambda w, h: jnp.arcsinh(h),
    "cube": lambda w, h: h**3,
    "cbrt": lambda w, h: jnp.cbrt(h),
    "softplus": lambda w, h: jnp.log1p(jnp.exp(h)),
    "tanh_scaled": lambda w, h: 3.0 * jnp.tanh(h / 3.0),
    "logistic": lambda w, h: 4.0 * jax.nn.sigmoid(h) - 2.0,
    "expm1": lambda w, h: jnp.expm1(h / 2.0),
    "scale": lambda w, h: h * (jnp.abs(w[0]) + 0.5),
    "shift": lambda w, h: h + w[1],
    "divide": lambda w, h: h / (jnp.abs(w[2]) + 0.5),
    "matrix": lambda w, h: h @ (w + 3.0 * jnp.eye(WIDTH)),
    "matrix_left": lambda w, h: (w[:2, :2] + 3.0 * jnp.eye(2)) @ h,
    "additive": lambda w, h: _coupling(w, h, False),
    "affine": lambda w, h: _coupling(w, h, True),
    "reverse": lambda w, h: h[:, ::-1],
    "swap_halves": lambda w, h: jnp.concatenate(jnp.split(h, 2, -1)[::-1], -1),
    "pairs": lambda w, h: jnp.transpose(h.reshape(-1, 2, 2), (0, 2, 1)).reshape(
        h.shape
    ),
    "cumsum": lambda w, h: jnp.cumsum(h, -1),
    "roll": lambda w, h: jnp.roll(h, 1, -1),
    "permute": lambda w, h: h[:, PERMUTATION],
    "softplus_nn": lambda w, h: jax.nn.softplus(h),
    "logaddexp": lambda w, h: jnp.logaddexp(h, w[3]),
    "logit": lambda w, h: jax.scipy.special.logit(_squashed(h)),
    "logit_logs": lambda w, h: jnp.log(_squashed(h)) - jnp.log1p(-_squashed(h)),
    "logit_ratio": lambda w, h: jnp.log(_squashed(h) / (1 - _squashed(h))),
    "where": lambda w, h: _select(h),
    "masked": lambda w, h: _masked(w, h, False),
    "masked_where": lambda w, h: _masked(w, h, True),
    "leaky": lambda w, h: jax.nn.leaky_relu(h, 0.3),
    "scan": lambda w, h: lax.scan(_scan_step, h, jnp.stack([w, -w]))[0],
    "scan_leaky": lambda w, h: lax.scan(_leaky_scan_step, h, jnp.stack([w, -w]))[0],
    "checkpoint": _checkpointed,
    "jit": lambda w, h: _jitted(h),
}
# Layers that act across the batch (the per-example mode refuses them).
ACROSS_BATCH = {"matrix_left"}


@dataclasses.dataclass
class Flow:
    seed: int
    layers: tuple[str, ...]
    batch_ndim: int

    def __call__(self, ws, h):
        for name, w in zip(self.layers, ws):
            h = LAYERS[name](w, h)
        return h

    def describe(self) -> str:
        chain = " -> ".join(self.layers)
        return f"seed {self.seed}, batch_ndim={self.batch_ndim}: {chain}"


def draw(seed: int) -> tuple[Flow, jax.Array, jax.Array]:
    """A random flow, its weights and its input."""
    rng = np.random.default_rng(seed)
    names = sorted(LAYERS)
    layers = tuple(rng.choice(names, size=rng.integers(1, 7)))
    ws = jnp.asarray(0.5 * rng.standard_normal((len(layers), WIDTH, WIDTH)))
    x = jnp.asarray(rng.standard_normal((BATCH, WIDTH)))
    return Flow(seed, layers, int(rng.integers(0, 2))), ws, x


# JAX's derivative rules compute small derivatives from outputs by
# cancellation (tanh's as 1 - y**2, expm1's as y + 1, logistic's as
# y (1 - y)), so the reference is not accurate to 1e-10 where a layer's
# Jacobian has a singular value below this; such draws are skipped.
RELIABLE = 1e-6


@functools.cache
def _layer_slogdet(name: str, per_example: bool):
    """``slogdet(jax.jacfwd(layer))`` at the layer's input, whole or one per
    example, and the Jacobian's smallest singular value: compiled once per
    layer, so that a program costs no compile."""
    f = LAYERS[name]

    def of(jac):
        return jnp.linalg.slogdet(jac)[1], jnp.min(jnp.linalg.svd(jac)[1])

    def whole(w, h):
        return of(
            jax.jacfwd(lambda v: jnp.ravel(f(w, v.reshape(h.shape))))(jnp.ravel(h))
        )

    def one(w, hb):
        return of(jax.jacfwd(lambda v: f(w, v[None])[0])(hb))

    return jax.jit(jax.vmap(one, (None, 0)) if per_example else whole)


def reference(flow: Flow, ws, x):
    """The chain's ``slogdet(jacfwd)``: a composition's Jacobian is the product
    of its layers', so its log-determinant is the sum of theirs, each taken at
    the layer's own input. Also the smallest singular value of those
    Jacobians, and the sum of the layers' log-determinants' sizes (the scale
    of the reference's rounding)."""
    total, scale, smallest, h = 0.0, 0.0, np.inf, x
    for name, w in zip(flow.layers, ws):
        ld, sv = _layer_slogdet(name, flow.batch_ndim == 1)(w, h)
        total, scale = total + ld, scale + jnp.abs(ld)
        smallest = min(smallest, float(jnp.min(sv)))
        h = LAYERS[name](w, h)
    return total, smallest, scale


def check(flow: Flow, ws, x, log_det=revnet.forward_and_log_det) -> str:
    """``"ok"``, ``"refused"`` (a per-example flow across the batch),
    ``"skipped"`` (values beyond 1e8: the chain overflowed; or a layer's
    Jacobian has a singular value below :data:`RELIABLE`, where JAX's
    derivative rules lose the digits the reference needs, while the derived
    log-det, in stable forms, keeps them) or what was wrong."""
    per_example = flow.batch_ndim == 1
    try:
        y, ld = log_det(flow, ws, x, known_argnums=0, batch_ndim=flow.batch_ndim)
    except revnet.NotInvertibleError as e:
        if per_example and ACROSS_BATCH & set(flow.layers):
            return "refused"
        return f"refused wrongly: {str(e).splitlines()[0]}"
    if per_example and ACROSS_BATCH & set(flow.layers):
        return "accepted a flow that mixes examples"
    if not np.all(np.abs(np.asarray(y)) < 1e8):
        return "skipped"  # the random chain overflowed: no fair comparison
    same = tolerance("float64", "values")  # the same operations
    if not np.allclose(y, flow(ws, x), rtol=same, atol=same):
        return "outputs differ from the function's"
    want, smallest, scale = reference(flow, ws, x)
    if not np.all(np.isfinite(want)) or smallest < RELIABLE:
        return "skipped"  # the reference's small derivatives are inexact
    if np.shape(ld) != np.shape(want):
        return f"log-det of shape {np.shape(ld)}, not {np.shape(want)}"
    if not np.all(np.abs(ld - want) <= RTOL * scale + ATOL):
        return f"log-det {np.asarray(ld)} != slogdet(jacfwd) {np.asarray(want)}"
    return "ok"


def run(
    programs: int, seed: int = 0, log_det=revnet.forward_and_log_det
) -> tuple[collections.Counter, list[str]]:
    """Checks ``programs`` random flows; returns the outcome counts (per
    outcome, and per layer: ``(layer, outcome)``) and the failures."""
    counts: collections.Counter = collections.Counter()
    failures = []
    with jax.enable_x64(True):
        for i in range(programs):
            flow, ws, x = draw(seed * 1_000_003 + i)
            outcome = check(flow, ws, x, log_det)
            key = outcome if outcome in ("ok", "refused", "skipped") else "wrong"
            counts[key] += 1
            for name in set(flow.layers):
                counts[name, key] += 1
            if key == "wrong":
                failures.append(f"{flow.describe()}: {outcome}")
    return counts, failures


def table(counts: collections.Counter) -> str:
    """The outcome counts, in total and per layer."""
    keys = ("ok", "refused", "skipped", "wrong")
    lines = [f"{'layer':<14}" + "".join(f"{k:>9}" for k in keys)]
    for name in sorted(LAYERS):
        lines.append(f"{name:<14}" + "".join(f"{counts[name, k]:>9}" for k in keys))
    lines.append(f"{'total':<14}" + "".join(f"{counts[k]:>9}" for k in keys))
    return "\n".join(lines)
