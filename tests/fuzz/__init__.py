"""Random-program fuzzer for ``revnet.invertible``, ``revnet.inverse``, ``revnet.scan``.

Each random program acts on two float streams ``a`` and ``b`` of shape
``(batch, d)`` and closes over a dict of weights. A program is generated as
Python *source* (one block of lines per operation) and built with ``exec``, so
the text printed for a failure is exactly the program that ran. Every program
is checked against plain JAX, eagerly (no ``jit`` per program: compiling would
dominate):

* the values of ``revnet.invertible(f)(a, b)`` equal ``f(a, b)``;
* the gradient of ``sum(sin(outputs))`` with respect to both inputs and every
  closed-over weight leaf equals plain ``jax.grad``, elementwise
  (:func:`tests.helpers.assert_trees_close`, rtol 1e-4 in float32, 1e-9 in
  float64, 2e-2 in half precision, where the results must also be as close to
  a float32 computation as plain JAX's);
* ``revnet.inverse(f, a, b)(f(a, b))`` rebuilds ``(a, b)``;
* constructs that lose information (a multiplication by a zero literal, a
  narrowing cast) are refused with ``NotInvertibleError`` at trace time;
* programs with a decision or a kink (:data:`TIED`: comparisons, ``rem``,
  bucketing, quantisation, reductions, clamps, and decisions inside a
  ``scan``, ``checkpoint``, ``cond`` or custom rule) start from *tied* inputs
  (halves: values exactly on thresholds, multiples and bucket edges), which a
  matrix product right after the decision makes the backward pass rebuild with
  rounding error; they run with ``kinks="store"``, and their gradients must
  still equal ``jax.grad``'s.

The plain reference runs the same source with ``jax.lax.scan``,
``jax.lax.fori_loop`` and ``revnet.scan`` as Python loops, ``jax.lax.cond`` and
``jax.lax.switch`` as selects, and ``jax.jit`` and ``jax.checkpoint`` as plain
calls: the same function, with nothing to compile.

Programs are drawn from *constructs*, each of which can be switched on or off
(:data:`CONSTRUCTS`). The run counts, per construct and in total, the programs
tried, accepted (not refused at trace time), refused (``NotInvertibleError`` at
trace time), those that raised anything else (``raised``) and those that were
``wrong``: a refused program that must be accepted, an accepted one that must be
refused, a mismatch, or an error (errors count as wrong too). A program counts
in the row of every construct it contains. Two kinds of draw are redrawn before
they are counted, and the run reports how many: programs whose plain forward
pass has huge intermediates, and programs with a numerical mismatch whose
inputs cannot be rebuilt at their precision at all (:func:`ill_conditioned`:
``(x / 2) ** 3`` twice, then ``+ tanh(...)``, loses ``x`` in float32).

Run it from the repository root::

    python -m tests.fuzz --programs 20000 --seed 1 --jobs 2
    python -m tests.fuzz --programs 500 --only custom_vjp,nested_jit
    python -m tests.fuzz --programs 500 --disable half_dot --verbose

It prints the counts table and, for each construct, the first failures with
their message and their (shrunk) source. The exit status is 1 when a program was
wrong.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import multiprocessing
import textwrap
import time
import traceback
import types
import warnings
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

import revnet
from tests.helpers import assert_trees_close

# --------------------------------------------------------------------------- #
# Custom rules used by the programs. Their names appear in the printed source.


@jax.custom_vjp
def grad_reverse(x):
    """Identity forward; the backward pass negates the cotangent."""
    return x


grad_reverse.defvjp(lambda x: (x, None), lambda _, g: (-g,))

CLIP = 0.3


@jax.custom_vjp
def grad_clip(x):
    """Identity forward; the backward pass clips the cotangent to [-CLIP, CLIP]."""
    return x


grad_clip.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -CLIP, CLIP),))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def grad_scale(s, x):
    """Identity forward; the backward pass scales the cotangent by static ``s``."""
    return x


grad_scale.defvjp(lambda s, x: (x, None), lambda s, _, g: (g * s,))


def grad_scaler(s):
    """A fresh ``custom_vjp`` whose backward pass closes over ``s``."""

    @jax.custom_vjp
    def scaled(x):
        return x

    scaled.defvjp(lambda x: (x, None), lambda _, g: (g * s,))
    return scaled


@jax.custom_jvp
def ste_scale(x):
    """``3 x`` forward, straight-through (identity) tangent."""
    return x * 3.0


ste_scale.defjvp(lambda p, t: (ste_scale(p[0]), t[0]))


@jax.custom_jvp
def ste_sinh(x):
    """``sinh(x / 2)`` forward, tangent ``t / 2`` (the ``cosh`` is dropped)."""
    return jnp.sinh(x * 0.5)


ste_sinh.defjvp(lambda p, t: (ste_sinh(p[0]), t[0] * 0.5))


@jax.custom_jvp
def ste_asinh(x):
    """``asinh(x)`` forward, tangent ``t / (1 + x^2)`` (not the true one)."""
    return jnp.arcsinh(x)


ste_asinh.defjvp(lambda p, t: (ste_asinh(p[0]), t[0] / (1.0 + p[0] * p[0])))


@jax.custom_jvp
def ste_round(x):
    """``round(x)`` forward, straight-through tangent: a decision in a body."""
    return jnp.round(x)


ste_round.defjvp(lambda p, t: (ste_round(p[0]), t[0]))


@jax.custom_vjp
def ste_sign(x):
    """``sign(x)`` forward, the cotangent passed through: a decision in a body."""
    return jnp.sign(x)


ste_sign.defvjp(lambda x: (jnp.sign(x), None), lambda _, g: (g,))


# The module-level reversible function of the ``static_jit`` construct. Its body
# runs the program under test, which reads its static hyper-parameter from the
# program's ``holder`` (set by the jitted step below at trace time).
CTX: dict = {}


def static_body(a, b):
    """Runs ``CTX["f"]``: the program under test in the ``static_jit`` mode."""
    return CTX["f"](a, b)


# Kinks are stored: programs with decisions start from tied inputs, where a
# relu's derivative at an exact zero would follow the rebuilt value.
STATIC_INVERTIBLE = revnet.invertible(static_body, kinks="store")


def _loss(outs):
    total = 0.0
    for y in outs:
        if jnp.finfo(y.dtype).bits < 32:
            y = y.astype(jnp.float32)
        total = total + jnp.sum(jnp.sin(y))
    return total


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def static_step(ws, a, b, s, token, rev):
    """The jitted training step of ``static_jit``: ``s`` is static, so it retraces.

    Args:
      ws: the weights dict.
      a: first stream.
      b: second stream.
      s: the static hyper-parameter, read by the program's ``custom_vjp``.
      token: identifies the program (a new program must retrace).
      rev: use the module-level :data:`STATIC_INVERTIBLE` (else the plain body).

    Returns:
      ``((loss, outputs), (grad_ws, grad_a, grad_b))``.
    """
    del token
    holder = CTX["holder"]

    def loss(ws, a, b):
        holder["ws"], holder["s"] = ws, s
        outs = (STATIC_INVERTIBLE if rev else static_body)(a, b)
        return _loss(outs), outs

    return jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(ws, a, b)


# --------------------------------------------------------------------------- #
# Constructs: each op generator returns source lines acting on streams x, y.

FAMILIES = {  # name: (stream dtype, x64)
    "f32": (jnp.float32, False),
    "f32x64": (jnp.float32, True),
    "f64": (jnp.float64, True),
    "f16": (jnp.float16, False),
    "bf16": (jnp.bfloat16, False),
}
HALF = ("f16", "bf16")
FULL = ("f32", "f32x64", "f64")
ALL = FULL + HALF
FAMILY_WEIGHTS = {"f32": 3.0, "f32x64": 1.0, "f64": 3.0, "f16": 1.0, "bf16": 1.0}
RTOL = {"f32": 1e-4, "f32x64": 1e-4, "f64": 1e-9, "f16": 2e-2, "bf16": 2e-2}
# Every this-many-th program is also called eagerly, outside jax.grad.
EAGER_EVERY = 4
# Random perturbations of the outputs tried by ill_conditioned.
PROBES = 6
# Largest |intermediate| of the plain forward pass for a program to be counted.
BOUND = {"f32": 20.0, "f32x64": 20.0, "f64": 20.0, "f16": 8.0, "bf16": 8.0}
_DTYPE_SRC = {
    jnp.dtype(jnp.float16): "jnp.float16",
    jnp.dtype(jnp.bfloat16): "jnp.bfloat16",
    jnp.dtype(jnp.float32): "jnp.float32",
    jnp.dtype(jnp.float64): "jnp.float64",
}


class _Gen:
    """Generation state of one program: randomness, weights, stream dtypes."""

    def __init__(self, rng: np.random.Generator, family: str, d: int, batch: int):
        self.rng = rng
        self.family = family
        self.d = d
        self.batch = batch
        self.weights: dict[str, tuple[tuple[int, ...], str]] = {}
        self.dtypes = {"a": jnp.dtype(FAMILIES[family][0])}
        self.dtypes["b"] = self.dtypes["a"]
        self.n = 0  # index of the op being generated: names its weights
        self.tied = False  # whether the inputs will be tied (:data:`TIED`)

    def c(self, lo: float = 0.1, hi: float = 1.0) -> str:
        return f"{self.rng.uniform(lo, hi):.3g}"

    def w(self, shape: Iterable[int], kind: str = "normal") -> str:
        name, k = f"w{self.n}", 0
        while name in self.weights:  # the op's second weight, or third
            k += 1
            name = f"w{self.n}_{k}"
        self.weights[name] = (tuple(shape), kind)
        return f'w["{name}"]'

    def pick(self, options):
        return options[int(self.rng.integers(len(options)))]


def _unary(g: _Gen, x: str, y: str):
    ops = {
        "scale": f"{x} = {x} * {g.c(0.6, 1.5)}",
        "shift": f"{x} = {x} + {g.c()}",
        "negate": f"{x} = -{x}",
        "divide": f"{x} = {x} / {g.c(1.1, 2.0)}",
        "sinh": f"{x} = jnp.sinh({x} * 0.5)",
        "asinh": f"{x} = jnp.arcsinh({x})",
        "cube": f"{x} = ({x} * 0.5) ** 3",
        "tanh_scaled": f"{x} = jnp.arctanh(jnp.tanh({x}) * 0.5)",
        "exp_log": f"{x} = jnp.log(jnp.exp({x}) + 1.0)",
        "flip": f"{x} = jnp.flip({x}, -1)",
        "cumsum": f"{x} = jnp.cumsum({x}, axis=-1) * 0.5",
    }
    names = list(ops)
    if g.family in HALF:
        names = ["scale", "shift", "negate", "divide", "flip"]
    if g.tied:  # tied inputs hold zeros, where the inverse of a cube is singular
        names.remove("cube")
    name = g.pick(names)
    return name, [ops[name]]


def _coupling(g, x, y):
    if g.rng.uniform() < 0.15:  # a dot_general with a batch dimension
        w = g.w((g.batch, g.d, g.d))
        dot = f'jnp.einsum("bi,bij->bj", {y}, {w})'
        return "batched_dot", [f"{x} = {x} + jnp.tanh({dot}) * {g.c()}"]
    return "tanh", [f"{x} = {x} + jnp.tanh({y} @ {g.w((g.d, g.d))}) * {g.c()}"]


def _mix(g, x, y):
    return "relu", [f"{x} = {x} - jax.nn.relu({y}) * {g.c()}"]


def _halves(g, x, y):
    h, n = g.d // 2, g.n
    return "concat", [
        f"lo{n}, hi{n} = {x}[..., :{h}], {x}[..., {h}:]",
        f"{x} = jnp.concatenate([hi{n}, lo{n} * {g.c(1.1, 2.0)}], -1)",
    ]


def _eye_plus(g, w):
    return f"(jnp.eye({g.d}, dtype={w}.dtype) + {w} * 0.1)"


def _dot(g, x, y):
    variant = g.pick(["right", "left", "known_matrix"])
    if variant == "known_matrix":  # the weight is the matrix: eye + noise
        m = g.w((g.d, g.d), "eye")
    else:
        m = _eye_plus(g, g.w((g.d, g.d)))
    if variant == "left":
        return variant, [f"{x} = ({m} @ {x}.T).T"]
    return variant, [f"{x} = {x} @ {m}"]


def _custom_vjp(g, x, y):
    variant = g.pick(["reverse", "clip", "scale", "reverse_in_branch", "clip_twice"])
    k = g.c(1.5, 2.5)
    if variant == "reverse":
        return variant, [f"{x} = grad_reverse({x}) * {k}"]
    if variant == "clip":
        return variant, [f"{x} = grad_clip({x}) * {k}"]
    if variant == "scale":
        return variant, [f"{x} = grad_scale({g.c(-2.0, 2.0)}, {x}) * {k}"]
    if variant == "clip_twice":
        return variant, [f"{x} = grad_clip(grad_reverse({x}) * {k}) - {g.c()}"]
    w = g.w((g.d, g.d))
    return variant, [f"{x} = {x} + jnp.tanh(grad_reverse({y}) @ {w}) * {g.c()}"]


def _custom_jvp(g, x, y):
    variant = g.pick(["ste_scale", "ste_sinh", "ste_asinh", "ste_in_branch"])
    if variant == "ste_in_branch":
        return variant, [f"{x} = {x} + ste_sinh({y}) * {g.c()}"]
    return variant, [f"{x} = {variant}({x})"]


def _nested_jit(g, x, y):
    variant = g.pick(["mul", "dot", "coupling"])
    if variant == "mul":
        w = g.w((g.d,), "positive")
        return variant, [f"{x} = jax.jit(lambda z: z * {w})({x})"]
    if variant == "dot":
        m = _eye_plus(g, g.w((g.d, g.d)))
        return variant, [f"{x} = jax.jit(lambda z: z @ {m})({x})"]
    w = g.w((g.d, g.d))
    return variant, [f"{x} = jax.jit(lambda z: z + jnp.tanh({y} @ {w}) * {g.c()})({x})"]


def _static_jit(g, x, y):
    variant = g.pick(["nondiff_argnums", "closure"])
    if variant == "closure":
        return variant, [f'{x} = grad_scaler(holder["s"])({x}) * 2.0']
    return variant, [f'{x} = grad_scale(holder["s"], {x}) * 2.0']


def _zero_literal(g, x, y):
    variant = g.pick(["times_zero", "zero_times_sinh", "where", "zeroed_coupling"])
    if variant == "times_zero":
        return variant, [f"{x} = {x} * 0.0"]
    if variant == "zero_times_sinh":
        return variant, [f"{x} = 0 * jnp.sinh({x})"]
    if variant == "where":
        mask = [bool(v) for v in g.rng.integers(0, 2, g.d)]
        mask[int(g.rng.integers(g.d))] = False  # at least one zeroed element
        return variant, [f"{x} = jnp.where(np.array({mask}), {x}, {x} * 0)"]
    w = g.w((g.d, g.d))
    return variant, [f"{x} = {x} * 0.0 + jnp.tanh({y} @ {w})"]


def _narrowing_cast(g, x, y):
    src = g.dtypes[x]  # the family's dtype: refused programs never widen
    narrower = [jnp.float16, jnp.bfloat16]
    if src == jnp.float64:
        narrower.append(jnp.float32)
    to = jnp.dtype(g.pick(narrower))
    if g.rng.uniform() < 0.5:  # a detour back to the original dtype
        line = f"{x} = {x}.astype({_DTYPE_SRC[to]}).astype({_DTYPE_SRC[src]})"
        return f"detour_{to.name}", [line]
    g.dtypes[x] = to
    return f"to_{to.name}", [f"{x} = {x}.astype({_DTYPE_SRC[to]})"]


def _widening_cast(g, x, y):
    to = jnp.float64 if g.dtypes[x] == jnp.float32 else jnp.float32
    g.dtypes[x] = jnp.dtype(to)
    return f"to_{jnp.dtype(to).name}", [f"{x} = {x}.astype({_DTYPE_SRC[g.dtypes[x]]})"]


def _dup_slices(g, x, y):
    n, k = g.n, int(g.rng.choice([1, 2, 3], p=[0.15, 0.7, 0.15]))
    variant = g.pick(["hi_twice", "hi_twice_swapped", "lo_twice"])
    if variant == "lo_twice":
        w = g.w((k, g.d - k))
        return variant, [
            f"lo{n}a = {x}[:, :{k}]",
            f"hi{n} = {x}[:, {k}:]",
            f"lo{n}b = {x}[:, :{k}]",
            f"{x} = jnp.concatenate([lo{n}a, hi{n} + jnp.tanh(lo{n}b @ {w})], -1)",
        ]
    w = g.w((g.d - k, k))
    first, second = ("a", "b") if variant == "hi_twice" else ("b", "a")
    c = g.c()
    return variant, [
        f"lo{n} = {x}[:, :{k}]",
        f"hi{n}{first} = {x}[:, {k}:]",
        f"hi{n}{second} = {x}[:, {k}:]",
        f"{x} = jnp.concatenate([lo{n} + jnp.tanh(hi{n}a @ {w}) * {c}, hi{n}b], -1)",
    ]


def _scan_body(g, name, ys):
    return [
        f"def {name}(c, v):",
        "    p, q = c",
        f"    p = p + jnp.tanh(q @ v) * {g.c()}",
        f"    q = q - jnp.tanh(p @ v.T) * {g.c()}",
        f"    return (p, q), {ys}",
    ]


def _decision(g, x, y):
    """A decision on ``y`` steering the update of ``x``.

    Programs with a decision start from quantised streams (halves in
    ``[-1.5, 1.5]``, see :func:`materialise`), so the decision's inputs hold
    exact ties (zeros, half-integers, equal entries of a row) where the
    backward pass rebuilds them with rounding error: a stored decision must be
    used there, never made again.
    """
    n, d, c = g.n, g.d, g.c()
    t = f"jnp.tanh({y} @ {g.w((d, d))})"
    one_hot = f"jax.nn.one_hot({{}}, {d}, dtype={x}.dtype)"
    variants = {
        "gt": [f"{x} = {x} + jnp.where({y} > 0, {t}, jnp.sin({y})) * {c}"],
        "sign": [f"{x} = {x} + jnp.sign({y}) * {t} * {c}"],
        "round": [f"{x} = {x} + jnp.round({y}) * {t} * {c}"],
        "argmax": [f"{x} = {x} + {one_hot.format(f'jnp.argmax({y}, -1)')} * {t} * {c}"],
        "top_k": [
            f"gate{n} = jnp.sum({one_hot.format(f'jax.lax.top_k({y}, 2)[1]')}, -2)",
            f"{x} = {x} + gate{n} * {t} * {c}",
        ],
        "approx_max_k": [
            f"i{n} = jax.lax.approx_max_k({y}, 2)[1]",
            f"{x} = {x} + jnp.sum({one_hot.format(f'i{n}')}, -2) * {t} * {c}",
        ],
        "top_k_values": [
            f"top{n} = jax.lax.top_k({y}, 2)[0] * jnp.arange(1, 3)",
            f"{x} = {x} + jnp.sum(top{n}, -1, keepdims=True) * {c}",
        ],
        "sort": [f"{x} = {x} + jnp.sort({y}, -1) * jnp.arange({d}) * {c}"],
        "int_cast": [
            f"k{n} = ({y} + 0.5).astype(jnp.int32).astype({x}.dtype)",
            f"{x} = {x} + k{n} * {t} * {c}",
        ],
    }
    name = g.pick(list(variants))
    return name, variants[name]


# The constructs below start from tied inputs too (see :data:`TIED`): each
# reads ``y`` where the forward values sit exactly on a threshold, a multiple or
# a bucket edge, so the same operation evaluated on rebuilt values may land on
# the other side.


def _jump(g, z: str, t: str) -> tuple[str, str]:
    """An expression of ``z`` that jumps at ``z``'s ties, times ``t``; its kind."""
    h = g.pick(["0.0", "0.5", "-0.5", "1.0"])  # a threshold on the halves
    kinds = {
        "gt": f"jnp.where({z} > {h}, {t}, jnp.sin({z}))",
        "sign": f"jnp.sign({z} - {h}) * {t}",
        "round": f"jnp.round({z}) * {t}",
        "argmax": f"jax.nn.one_hot(jnp.argmax({z}, -1), {g.d}, dtype={z}.dtype) * {t}",
        "mod": f"jnp.mod({z}, 0.5) * {t}",
    }
    kind = g.pick(list(kinds))
    return kind, kinds[kind]


def _nested_decision(g, x, y):
    """A decision on ``y`` inside a loop, a checkpoint, a branch or a custom rule.

    The backward pass evaluates such a call forward on rebuilt values, so the
    decisions inside it must be stored and replayed as at the top level.
    """
    n, d, c = g.n, g.d, g.c()
    steps = int(g.rng.integers(1, 3))
    where = g.pick(
        [
            "scan_in_f",
            "scan_carry",
            "scan_pair",
            "fori_loop",
            "checkpoint",
            "checkpoint_update",
            "cond_branch",
            "cond_pred",
            "switch",
            "custom_jvp",
            "custom_vjp",
        ]
    )
    if where in ("scan_in_f", "scan_carry", "scan_pair"):
        w = g.w((steps, d, d))
        z = "q" if where == "scan_pair" else y
        kind, e = _jump(g, z, f"jnp.tanh({z} @ v)")
        if where == "scan_pair":  # y rides in the carry, unchanged
            lines = [
                f"def dstep{n}(pq, v):",
                "    p, q = pq",
                f"    return (p + {e} * {c}, q), None",
                f"({x}, {y}), _ = jax.lax.scan(dstep{n}, ({x}, {y}), {w})",
            ]
        else:  # y is a constant of the scan; x its carry or a sum F adds
            init = "jnp.zeros_like(" + x + ")" if where == "scan_in_f" else x
            call = f"jax.lax.scan(dstep{n}, {init}, {w})[0]"
            lines = [
                f"def dstep{n}(p, v):",
                f"    return p + {e} * {c}, None",
                f"{x} = {x} + {call}" if where == "scan_in_f" else f"{x} = {call}",
            ]
    elif where == "fori_loop":  # k-means-like routing, step after step
        w = g.w((steps, d, d))
        kind, e = _jump(g, y, f"jnp.tanh({y} @ {w}[i])")
        body = f"lambda i, acc: acc + {e} * {c}"
        lines = [
            f"{x} = {x} + jax.lax.fori_loop(0, {steps}, {body}, jnp.zeros_like({x}))"
        ]
    elif where == "checkpoint":  # the checkpointed function is part of F
        kind, e = _jump(g, "z", f"jnp.tanh(z @ {g.w((d, d))})")
        lines = [f"{x} = {x} + jax.checkpoint(lambda z: {e})({y}) * {c}"]
    elif where == "checkpoint_update":  # the whole update is checkpointed
        kind, e = _jump(g, "q", f"jnp.tanh(q @ {g.w((d, d))})")
        lines = [f"{x} = jax.checkpoint(lambda p, q: p + {e} * {c})({x}, {y})"]
    elif where in ("cond_branch", "cond_pred"):
        kind, e = _jump(g, "z", f"jnp.tanh(z @ {g.w((d, d))})")
        other = f"jnp.sin(z) * {g.c()}"
        if where == "cond_branch":  # a known predicate, a decision in a branch
            pred = f"{g.w((1,))}[0] > 0"
        else:  # the predicate itself reads y: ties where y sums to zero
            pred = f"jnp.sum({y}) > 0"
        branches = f"lambda z: {e}, lambda z: {other}"
        lines = [f"{x} = {x} + jax.lax.cond({pred}, {branches}, {y}) * {c}"]
    elif where == "switch":  # the index is an argmax over y's column sums
        kind, e = _jump(g, "z", f"jnp.tanh(z @ {g.w((d, d))})")
        branches = f"[lambda z: {e}, lambda z: jnp.sin(z), lambda z: z * {g.c()}]"
        index = f"jnp.argmax(jnp.sum({y}, 0)) % 3"
        lines = [f"{x} = {x} + jax.lax.switch({index}, {branches}, {y}) * {c}"]
    else:  # a custom rule whose body decides
        kind = "round" if where == "custom_jvp" else "sign"
        fn = "ste_round" if where == "custom_jvp" else "ste_sign"
        t = f"jnp.tanh({y} @ {g.w((d, d))})"
        lines = [f"{x} = {x} + {fn}({y}) * {t} * {c}"]
    return f"{where}:{kind}", lines


def _rem(g, x, y):
    """``rem`` (sawtooth features): jumps at the multiples of the modulus."""
    m, c = g.pick(["0.5", "1.0"]), g.c()
    t = f"jnp.tanh({y} @ {g.w((g.d, g.d))})"
    variants = {
        "mod": f"jnp.mod({y}, {m})",
        "percent": f"({y} % {m})",
        "fmod": f"jnp.fmod({y}, {m})",
        "lax_rem": f"jax.lax.rem({y}, jnp.full_like({y}, {m}))",
        "sawtooth": f"jnp.sin(jnp.mod({y}, {m}) * 3.0)",
    }
    name = g.pick(list(variants))
    return name, [f"{x} = {x} + {variants[name]} * {t} * {c}"]


HALVES = (-1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5)


def _bucketing(g, x, y):
    """Bucket indices of ``y`` (edges on its ties) gathering a learned table."""
    n, d, c = g.n, g.d, g.c()
    k = int(g.rng.integers(2, 6))
    edges = f"jnp.array({sorted(g.rng.choice(HALVES, k, replace=False).tolist())}, "
    edges += f"{y}.dtype)"
    method = g.pick(["scan", "scan_unrolled", "sort", "compare_all", "digitize"])
    if method == "digitize":
        right = bool(g.rng.integers(2))
        index, variant = f"jnp.digitize({y}, {edges}, right={right})", method
    else:
        side = g.pick(["left", "right"])
        index = f'jnp.searchsorted({edges}, {y}, side="{side}", method="{method}")'
        variant = f"{method}_{side}"
    if g.rng.uniform() < 0.5:  # one learned scalar per bucket
        gather, variant = f"{g.w((k + 1,))}[idx{n}]", variant + ":scalar"
    else:  # a learned row per bucket, one entry per feature
        gather = f"jnp.take_along_axis({g.w((k + 1, d))}, idx{n}, 0)"
        variant += ":rows"
    t = f"jnp.tanh({y} @ {g.w((d, d))})"
    return variant, [f"idx{n} = {index}", f"{x} = {x} + {gather} * {t} * {c}"]


def _quantised(g, x, y, quant: Callable[[str], str], m: int):
    """Lines adding ``q(u) * tanh(y @ w)`` to ``x`` (``u`` is ``y`` off the grid).

    ``q`` rounds to nearest with ``m`` mantissa bits; shifting the halves by
    ``2 ** -(m + 1)`` puts those in ``[1, 2)`` (``1``, ``1.5`` and ``-1.5``)
    exactly halfway between two representable values. Half of the time ``q``
    is a fake quantisation with a straight-through gradient.
    """
    n, c, u = g.n, g.c(), f"u{g.n}"
    t = f"jnp.tanh({y} @ {g.w((g.d, g.d))})"
    ste = bool(g.rng.integers(2))
    q = f"{u} + jax.lax.stop_gradient({quant(u)} - {u})" if ste else quant(u)
    return "ste" if ste else "plain", [
        f"{u} = {y} + {2.0 ** -(m + 1)!r}",
        f"q{n} = {q}",
        f"{x} = {x} + q{n} * {t} * {c}",
    ]


def _reduce_precision(g, x, y):
    """``lax.reduce_precision`` (fake FP8 quantisation) on a tie."""
    fmt = g.pick(["e4m3", "e5m2", "e8m7", "e5m10"])
    e, m = int(fmt[1]), int(fmt[3:])
    bits = f"exponent_bits={e}, mantissa_bits={m}"
    ste, lines = _quantised(
        g, x, y, lambda u: f"jax.lax.reduce_precision({u}, {bits})", m
    )
    return f"{fmt}:{ste}", lines


def _cast_round_trip(g, x, y):
    """A narrowing cast and back, written in F (quantisation-aware training)."""
    bits = {"bfloat16": 7, "float16": 10}
    if g.dtypes[y] == jnp.float64:
        bits["float32"] = 23
    to = g.pick(list(bits))
    ste, lines = _quantised(
        g, x, y, lambda u: f"{u}.astype(jnp.{to}).astype({u}.dtype)", bits[to]
    )
    return f"{to}:{ste}", lines


def _reduction_kink(g, x, y):
    """A reduction, pooling or cumulative maximum on equal entries of ``y``."""
    pool = "jax.lax.reduce_window({}, {}, jax.lax.{}, (1, 2), {}, {})"
    variants = {
        "max_axis": f"jnp.max({y}, -1, keepdims=True)",
        "min_axis": f"jnp.min({y}, -1, keepdims=True)",
        "max_batch": f"jnp.max({y}, 0)",
        "max_pool": pool.format(y, "-jnp.inf", "max", "(1, 1)", '"SAME"'),
        "min_pool": pool.format(y, "jnp.inf", "min", "(1, 1)", '"SAME"'),
        "max_pool_strided": "jnp.repeat("
        + pool.format(y, "-jnp.inf", "max", "(1, 2)", '"VALID"')
        + ", 2, -1)",
        "cummax": f"jax.lax.cummax({y}, 1)",
        "cummin": f"jax.lax.cummin({y}, 1, reverse=True)",
    }
    name = g.pick(list(variants))
    t = f"jnp.tanh({y} @ {g.w((g.d, g.d))})"
    return name, [f"{x} = {x} + {variants[name]} * {t} * {g.c()}"]


def _clamp_kink(g, x, y):
    """A clamp of ``y`` whose bounds are ties (``relu6``, ``hard_tanh`` too)."""
    variants = {
        "clamp": f"jax.lax.clamp(-0.5, {y}, 1.0)",
        "clip": f"jnp.clip({y}, -1.0, 0.5)",
        "relu6": f"jax.nn.relu6({y} * 4.0 + 2.0)",
        "hard_tanh": f"jax.nn.hard_tanh({y})",
    }
    name = g.pick(list(variants))
    t = f"jnp.tanh({y} @ {g.w((g.d, g.d))})"
    return name, [f"{x} = {x} + {variants[name]} * {t} * {g.c()}"]


def _scan_unused_ys(scan: str):
    def op(g, x, y):
        n, length = g.n, int(g.rng.integers(1, 4))
        ys = g.pick(["jnp.sum(p)", "p * 2.0", "(jnp.sum(q), p)", "None"])
        reverse = bool(g.rng.integers(2))
        w = g.w((length, g.d, g.d))
        call = f"{scan}(body{n}, ({x}, {y}), {w}" + (
            ", reverse=True)" if reverse else ")"
        )
        variant = ("reverse_" if reverse else "") + ("no_ys" if ys == "None" else "ys")
        return variant, [*_scan_body(g, f"body{n}", ys), f"({x}, {y}), _ = {call}"]

    return op


def _nested_revnet_scan(g, x, y):
    n, l1, l2 = g.n, int(g.rng.integers(1, 3)), int(g.rng.integers(1, 3))
    outer = g.pick(["revnet.scan", "jax.lax.scan"])
    w = g.w((l1, l2, g.d, g.d))
    return f"outer_{outer}", [
        *_scan_body(g, f"inner{n}", "jnp.sum(q)"),
        f"def outer{n}(c, v):",
        f"    c, _ = revnet.scan(inner{n}, c, v)",
        "    p, q = c",
        f"    return (q * {g.c(0.6, 1.5)}, p), jnp.sum(p)",
        f"({x}, {y}), _ = {outer}(outer{n}, ({x}, {y}), {w})",
    ]


def _fori_loop(g, x, y):
    n, length = g.n, int(g.rng.integers(1, 4))
    variant = g.pick(["indexed_weights", "shared_weight", "unrolled", "one_stream"])
    if variant == "one_stream":
        w = g.w((length, g.d))
        body = f"lambda i, z: z * {g.c(0.6, 1.5)} + {w}[i]"
        return variant, [f"{x} = jax.lax.fori_loop(0, {length}, {body}, {x})"]
    if variant == "shared_weight":
        w = g.w((g.d, g.d))
        v = w
    else:
        w = g.w((length, g.d, g.d))
        v = f"{w}[i]"
    unroll = ", unroll=2" if variant == "unrolled" else ""
    return variant, [
        f"def step{n}(i, c):",
        "    p, q = c",
        f"    p = p + jnp.tanh(q @ {v}) * {g.c()}",
        f"    q = q + jnp.tanh(p @ {v}.T) * {g.c()}",
        "    return p, q",
        f"{x}, {y} = jax.lax.fori_loop(0, {length}, step{n}, ({x}, {y}){unroll})",
    ]


@dataclasses.dataclass(frozen=True)
class Construct:
    """One kind of program element.

    Attributes:
      name: the construct's name (a row of the counts table).
      expect: ``"accept"`` or ``"refuse"`` (must raise ``NotInvertibleError``).
      families: the dtype families it can be drawn in.
      weight: how often it is drawn as an extra (non-featured) op.
      op: the op generator, or None for program-level constructs.
    """

    name: str
    expect: str
    families: tuple[str, ...]
    weight: float
    op: Callable | None = None


_C = Construct
CONSTRUCTS: dict[str, Construct] = {
    c.name: c
    for c in [
        _C("unary", "accept", ALL, 6.0, _unary),
        _C("coupling", "accept", ALL, 3.0, _coupling),
        _C("mix", "accept", ALL, 1.5, _mix),
        _C("halves", "accept", ALL, 1.5, _halves),
        _C("dot", "accept", FULL, 1.5, _dot),
        _C("custom_vjp", "accept", ALL, 1.0, _custom_vjp),
        _C("custom_jvp", "accept", FULL, 1.0, _custom_jvp),
        _C("nested_jit", "accept", FULL, 0.0, _nested_jit),
        _C("static_jit", "accept", ("f32", "f64"), 0.0, _static_jit),
        _C("zero_literal", "refuse", FULL, 0.0, _zero_literal),
        _C("narrowing_cast", "refuse", FULL, 0.0, _narrowing_cast),
        _C("widening_cast", "accept", ("f32x64", *HALF), 0.3, _widening_cast),
        _C("dup_slices", "accept", ALL, 1.0, _dup_slices),
        _C("decision", "accept", FULL, 1.0, _decision),
        _C("nested_decision", "accept", FULL, 0.0, _nested_decision),
        _C("rem", "accept", FULL, 0.08, _rem),
        _C("bucketing", "accept", FULL, 0.005, _bucketing),
        _C("reduce_precision", "accept", FULL, 0.08, _reduce_precision),
        _C("cast_round_trip", "accept", FULL, 0.08, _cast_round_trip),
        _C("reduction_kink", "accept", FULL, 0.06, _reduction_kink),
        _C("clamp_kink", "accept", FULL, 0.08, _clamp_kink),
        _C(
            "revnet_scan_unused_ys", "accept", FULL, 0.0, _scan_unused_ys("revnet.scan")
        ),
        _C("lax_scan_unused_ys", "accept", FULL, 0.0, _scan_unused_ys("jax.lax.scan")),
        _C("nested_revnet_scan", "accept", FULL, 0.0, _nested_revnet_scan),
        _C("fori_loop", "accept", FULL, 0.0, _fori_loop),
        _C("half_dot", "accept", HALF, 1.5, _dot),
        _C("zero_batch", "accept", ("f32",), 0.0),
        _C("scan_wrapper", "accept", FULL, 0.0),
    ]
}
# How often each construct is the featured one (the rest are drawn as extras);
# the expensive ones (a compile per program) are drawn less often.
FEATURE_WEIGHTS = {
    "unary": 1.0,
    "coupling": 1.0,
    "mix": 0.5,
    "halves": 0.5,
    "dot": 0.8,
    "custom_vjp": 1.5,
    "custom_jvp": 1.2,
    "nested_jit": 0.5,
    "static_jit": 0.03,
    "zero_literal": 0.8,
    "narrowing_cast": 0.8,
    "widening_cast": 0.4,
    "dup_slices": 1.2,
    "decision": 1.5,
    "nested_decision": 0.05,  # a loop, branch or checkpoint: compiles
    "rem": 0.12,
    "bucketing": 0.03,  # jnp.searchsorted's jitted call: compiles
    "reduce_precision": 0.1,
    "cast_round_trip": 0.1,
    "reduction_kink": 0.1,
    "clamp_kink": 0.1,
    "revnet_scan_unused_ys": 0.03,
    "lax_scan_unused_ys": 0.03,
    "nested_revnet_scan": 0.03,
    "fori_loop": 0.03,
    "half_dot": 0.9,
    "zero_batch": 0.2,
    "scan_wrapper": 0.03,
}
# Programs with any of these start from tied inputs (:func:`materialise`) and
# store kinks: a decision on a tie, or a kink whose derivative at a tie must be
# jax.grad's.
TIED = frozenset(
    [
        "decision",
        "nested_decision",
        "rem",
        "bucketing",
        "reduce_precision",
        "cast_round_trip",
        "reduction_kink",
        "clamp_kink",
    ]
)
MIN_FEATURED = 5  # round-robin over the enabled constructs first, this many each


# --------------------------------------------------------------------------- #
# Programs.


@dataclasses.dataclass
class Op:
    """One op of a program: its construct, variant and source lines."""

    construct: str
    variant: str
    lines: list[str]
    weights: dict[str, tuple[tuple[int, ...], str]]
    streams: tuple[str, str] = ("a", "b")  # the stream updated, the one read


@dataclasses.dataclass
class Program:
    """A random program and everything needed to check it.

    Attributes:
      seed: the run's seed; ``(seed, index)`` identifies the program.
      index: the program's index in the run.
      family: dtype family (a key of :data:`FAMILIES`).
      batch: batch size of the streams (0 for ``zero_batch``).
      d: width of the streams.
      mode: ``"invertible"``, ``"scan"`` (body of a ``revnet.scan``) or
        ``"static"`` (the ``static_jit`` construct).
      ops: the operations, in order.
      featured: the construct this program was drawn for.
      scan_length: steps of the ``scan`` mode.
    """

    seed: int
    index: int
    family: str
    batch: int
    d: int
    mode: str
    ops: list[Op]
    featured: str
    scan_length: int = 0

    @property
    def constructs(self) -> set[str]:
        out = {op.construct for op in self.ops}
        if self.batch == 0:
            out.add("zero_batch")
        if self.mode == "scan":
            out.add("scan_wrapper")
        return out

    @property
    def expect(self) -> str:
        refuse = any(CONSTRUCTS[op.construct].expect == "refuse" for op in self.ops)
        return "refuse" if refuse else "accept"

    @property
    def rounds(self) -> int:
        return 2 if "nested_jit" in self.constructs else 1

    @property
    def weights(self) -> dict[str, tuple[tuple[int, ...], str]]:
        out = {}
        for op in self.ops:
            out.update(op.weights)
        if self.mode == "scan":
            out["xs"] = ((self.scan_length, self.d), "normal")
        return out

    def source(self, scan: str = "SCAN", probe: bool = False) -> str:
        """The program as the source of ``def f(a, b)``."""
        body = []
        for op in self.ops:
            body += op.lines
            if probe:  # eager: a scan's body runs in a Python loop when probed
                body.append("PROBE(a, b)")
        if self.mode == "scan":
            inner = ["a, b = c", "a = a + t", *body, "return (a, b), jnp.sum(a)"]
            body = [
                "def body(c, t):",
                *("    " + line for line in inner),
                f'(a, b), ys = {scan}(body, (a, b), w["xs"])',
            ]
            if probe:
                body.append("PROBE(a, b, ys)")
            ret = "return a, b, ys"
        else:
            ret = "return a, b"
        lines = ["def f(a, b):", '    w = holder["ws"]']
        lines += ["    " + line for line in [*body, ret]]
        return "\n".join(lines)

    def describe(self) -> str:
        ops = ", ".join(f"{op.construct}:{op.variant}" for op in self.ops)
        return (
            f"program seed={self.seed} index={self.index} family={self.family} "
            f"batch={self.batch} mode={self.mode} ops=[{ops}]"
        )


def _draw_ops(g: _Gen, featured: str | None, n_ops: int, names: list[str]) -> list[Op]:
    pool = [n for n in names if CONSTRUCTS[n].op and CONSTRUCTS[n].weight > 0]
    pool = [n for n in pool if g.family in CONSTRUCTS[n].families]
    if g.family in HALF:
        pool = [n for n in pool if n != "dot"]
    if featured is not None and CONSTRUCTS[featured].expect == "refuse":
        pool = [n for n in pool if n != "widening_cast"]
    if not pool:  # only constructs that are never extras are enabled
        pool, n_ops = [featured or "coupling"], 1
    p = np.array([CONSTRUCTS[n].weight for n in pool]) + 1e-9
    plan = [pool[i] for i in g.rng.choice(len(pool), n_ops, p=p / p.sum())]
    follow = False  # a dot follows the first op, on the stream it read
    if featured is not None:
        # A decision early in the program reads the quantised inputs' ties. A
        # matrix product then changing the stream it read makes the backward
        # pass rebuild that stream by a solve, with rounding error (an additive
        # coupling mostly gives a half back exactly): a tie made again there
        # flips half of the time.
        first = featured in TIED and g.rng.uniform() < 0.8
        plan[0 if first else int(g.rng.integers(n_ops))] = featured
        if first and "dot" in names and g.rng.uniform() < 0.8:
            plan[1:2] = ["dot"]  # in place of the second op, or appended
            follow = True
    if g.family in HALF and "half_dot" in names and "half_dot" not in plan:
        plan.insert(int(g.rng.integers(n_ops + 1)), "half_dot")
    loops = {"revnet_scan_unused_ys", "lax_scan_unused_ys", "nested_revnet_scan"}
    loops |= {"fori_loop", "nested_decision"}
    if loops & set(plan):  # a loop's carry keeps its dtype
        plan = ["unary" if n == "widening_cast" else n for n in plan]
    widened = False
    g.tied = bool(TIED & set(plan))
    ops = []
    for n, name in enumerate(plan):
        if name == "widening_cast" and widened:
            name = "unary"
        x, y = ("a", "b") if g.rng.integers(2) == 0 else ("b", "a")
        if follow and n == 1:
            x, y = ops[0].streams[::-1]
        g.n = n
        before = dict(g.weights)
        variant, lines = CONSTRUCTS[name].op(g, x, y)
        widened |= name == "widening_cast"
        new = {k: v for k, v in g.weights.items() if k not in before}
        ops.append(Op(name, variant, lines, new, (x, y)))
    return ops


def draw_program(
    seed: int,
    index: int,
    enabled: Iterable[str],
    featured: str | None = None,
    weights: dict[str, float] | None = None,
) -> Program:
    """Draws program ``index`` of the run ``seed`` from the enabled constructs.

    Args:
      seed: the run's seed.
      index: the program's index.
      enabled: names of the constructs that may appear.
      featured: the construct the program is drawn for; None draws one.
      weights: how often each construct is featured, instead of
        :data:`FEATURE_WEIGHTS` (for those it names).

    Returns:
      The program.
    """
    names = [n for n in CONSTRUCTS if n in set(enabled)]
    rng = np.random.default_rng([seed, index])
    if featured is None:
        weights = {**FEATURE_WEIGHTS, **(weights or {})}
        w = np.array([weights[n] for n in names]) + 1e-12
        featured = names[int(rng.choice(len(names), p=w / w.sum()))]
    # Half-precision programs are drawn for half_dot (and widening casts from
    # half precision, which need a half_dot in the program to be drawn).
    # Each dtype (and float32 under x64) compiles every eager primitive anew, so
    # float32 under x64 is drawn for widening casts only, and zero-size batches
    # (float32 only) with few kinds of op.
    families = [f for f in CONSTRUCTS[featured].families if f in ("f32", "f64")]
    if featured == "widening_cast":
        families = ["f32x64"]
    if featured == "half_dot" or (featured == "widening_cast" and "half_dot" in names):
        families = list(CONSTRUCTS[featured].families)
    if featured == "zero_batch":
        names = [n for n in names if n in ("unary", "coupling", "dot")]
    fw = np.array([FAMILY_WEIGHTS[f] for f in families])
    family = families[int(rng.choice(len(families), p=fw / fw.sum()))]
    mode = {"static_jit": "static", "scan_wrapper": "scan"}.get(featured, "invertible")
    # Few distinct shapes: eager execution compiles each primitive per shape.
    batch = 0 if featured == "zero_batch" else 2
    d = 4
    g = _Gen(rng, family, d, batch)
    short = mode != "invertible" or family in HALF or batch == 0
    max_ops = 3 if short else 6
    n_ops = int(rng.integers(1, max_ops + 1))
    op_featured = featured if CONSTRUCTS[featured].op else None
    if mode == "scan":
        names = [n for n in names if CONSTRUCTS[n].weight > 0]
    ops = _draw_ops(g, op_featured, n_ops, names)
    if batch == 0 and not any(o.construct in ("coupling", "dot") for o in ops):
        g.n = len(ops)
        before = dict(g.weights)
        variant, lines = _dot(g, "a", "b")
        new = {k: v for k, v in g.weights.items() if k not in before}
        ops.append(Op("dot" if family in FULL else "half_dot", variant, lines, new))
    length = int(rng.integers(1, 4)) if mode == "scan" else 0
    return Program(seed, index, family, batch, d, mode, ops, featured, length)


def materialise(prog: Program, round_: int = 0, ties: bool | None = None):
    """The weights dict and the inputs ``(a, b)`` of a program (one round).

    Each leaf is drawn from its own seed, so that removing an op while shrinking
    leaves the other values unchanged. The inputs are tied (quantised) when
    ``ties`` is true, or, by default, when the program has a construct of
    :data:`TIED`.
    """
    dtype = FAMILIES[prog.family][0]
    ws = {}
    for n, (name, (shape, kind)) in enumerate(sorted(prog.weights.items())):
        r = np.random.default_rng([prog.seed, prog.index, round_, 7, n])
        if kind == "positive":
            v = (0.5 + r.uniform(size=shape)) * np.where(
                r.uniform(size=shape) < 0.5, -1, 1
            )
        elif kind == "eye":
            v = np.eye(shape[-1]) + 0.1 * r.standard_normal(shape)
        else:
            v = 0.4 * r.standard_normal(shape)
        ws[name] = jnp.asarray(v, dtype)
    r = np.random.default_rng([prog.seed, prog.index, 0, 3])
    a, b = (r.standard_normal((2, prog.batch, prog.d)) * 0.8).astype(np.float64)
    if _tied(prog) if ties is None else ties:  # zeros, halves, equal entries
        a, b = (
            np.clip(np.round(a * 2) / 2, -1.5, 1.5),
            np.clip(np.round(b * 2) / 2, -1.5, 1.5),
        )
    return ws, jnp.asarray(a, dtype), jnp.asarray(b, dtype)


def _py_scan(f, init, xs=None, length=None, reverse=False):
    """``lax.scan`` as a Python loop: the plain reference compiles nothing."""
    n = length if xs is None else jax.tree_util.tree_leaves(xs)[0].shape[0]
    carry, ys = init, [None] * n
    for i in reversed(range(n)) if reverse else range(n):
        x = None if xs is None else jax.tree_util.tree_map(lambda v: v[i], xs)
        carry, ys[i] = f(carry, x)
    if not n or ys[0] is None:
        return carry, None
    return carry, jax.tree_util.tree_map(lambda *v: jnp.stack(v), *ys)


def _py_fori_loop(lower, upper, body, init, unroll=None):
    """``lax.fori_loop`` as a Python loop."""
    del unroll
    carry = init
    for i in range(lower, upper):
        carry = body(i, carry)
    return carry


def _py_cond(pred, true_fun, false_fun, *operands):
    """``lax.cond`` as a select of both branches (finite in the programs)."""
    t, f = true_fun(*operands), false_fun(*operands)
    return jax.tree_util.tree_map(lambda u, v: jnp.where(pred, u, v), t, f)


def _py_switch(index, branches, *operands):
    """``lax.switch`` as a select of all branches (the index is clamped)."""
    index = jnp.clip(index, 0, len(branches) - 1)
    outs = [branch(*operands) for branch in branches]
    return jax.tree_util.tree_map(
        lambda *vs: functools.reduce(
            lambda acc, kv: jnp.where(index == kv[0], kv[1], acc), enumerate(vs), vs[0]
        ),
        *outs,
    )


class _Plain(types.SimpleNamespace):
    """A module's namespace with some names replaced (the plain reference's)."""

    def __init__(self, module, **replaced):
        super().__init__(_module=module, **replaced)

    def __getattr__(self, name):  # only names that are not replaced
        if name.startswith("__") or name == "_module":
            raise AttributeError(name)
        return getattr(self._module, name)


# The plain reference runs the program's loops as Python loops, its branches as
# selects, and its nested ``jit``s and checkpoints as plain calls: the same
# values, and no compilation per program.
_PLAIN_JAX = _Plain(
    jax,
    jit=lambda f: f,
    checkpoint=lambda f, **_: f,
    lax=_Plain(
        jax.lax,
        scan=_py_scan,
        fori_loop=_py_fori_loop,
        cond=_py_cond,
        switch=_py_switch,
    ),
)
_PLAIN_REVNET = types.SimpleNamespace(scan=_py_scan)


def _tied(prog: Program) -> bool:
    """Whether the program starts from tied inputs (it has a construct of TIED).

    Such programs store kinks too: at an exact tie a recomputed relu's
    derivative follows the rebuilt value (documented), not ``jax.grad``'s.
    """
    return bool(TIED & prog.constructs)


def _revnet_scan(prog: Program):
    return functools.partial(revnet.scan, kinks="store") if _tied(prog) else revnet.scan


def build(prog: Program, plain: bool = False, probe=None):
    """Builds ``f(a, b)`` of a program with ``exec``; returns ``(f, holder)``.

    Args:
      prog: the program.
      plain: build the plain reference: ``revnet.scan``, ``jax.lax.scan`` and
        ``jax.lax.fori_loop`` run as Python loops and ``jax.jit`` is a plain call.
      probe: build the probed plain reference: ``probe(*arrays)`` is called after
        each op.
    """
    holder: dict = {"ws": None, "s": 1.0}
    plain = plain or probe is not None
    ns = {
        "jax": _PLAIN_JAX if plain else jax,
        "jnp": jnp,
        "np": np,
        "revnet": _PLAIN_REVNET if plain else revnet,
        "holder": holder,
        "SCAN": _py_scan if plain else _revnet_scan(prog),
        "PROBE": probe,
        "grad_reverse": grad_reverse,
        "grad_clip": grad_clip,
        "grad_scale": grad_scale,
        "grad_scaler": grad_scaler,
        "ste_scale": ste_scale,
        "ste_sinh": ste_sinh,
        "ste_asinh": ste_asinh,
        "ste_round": ste_round,
        "ste_sign": ste_sign,
    }
    exec(prog.source(probe=probe is not None), ns)  # noqa: S102
    return ns["f"], holder


# --------------------------------------------------------------------------- #
# Checking one program.


class Wrong(AssertionError):
    """A program that revnet got wrong (not a numerical nuisance)."""


class Redraw(Exception):
    """The program must be redrawn: it is ill-conditioned, or says nothing."""


def _all_zero(tree) -> bool:
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
        if _all_zero(expected):
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


def _value_and_grad(fun, holder, ws, a, b):
    def loss(ws, a, b):
        holder["ws"] = ws
        outs = fun(a, b)
        return _loss(outs), outs

    try:
        return jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(ws, a, b)
    finally:
        holder["ws"] = ws


def _guard(prog: Program, ws, a, b, s=None):
    """Raises Redraw when the plain forward pass has huge intermediates."""
    seen = []

    def probe(*xs):
        seen.extend(jax.tree_util.tree_leaves(xs))

    f, holder = build(prog, probe=probe)
    holder["ws"] = ws
    if s is not None:
        holder["s"] = s
    seen.extend(f(a, b))
    # In numpy: a jnp reduction would compile once per shape and dtype.
    sizes = [np.max(np.abs(np.asarray(x, np.float64))) for x in seen if np.size(x)]
    big = float(max(sizes, default=0.0))
    if not np.isfinite(big) or big > BOUND[prog.family]:
        raise Redraw(f"intermediate of size {big:.3g}")


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
            outcome, message = _check_static(prog, invertible)
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
                tol = RTOL[prog.family] / 10
                compare(inv(nudged), rebuilt, tol, "sensitivity")
    except Wrong:
        return True
    except Exception:  # noqa: BLE001
        return False
    return False


def _accepted_then(exc: BaseException, stage: str) -> tuple[str, str]:
    if isinstance(exc, Wrong):
        return "mismatch", f"{stage}: {exc}"
    if isinstance(exc, revnet.NotInvertibleError):
        return "wrong", f"{stage}: NotInvertibleError after acceptance: {exc}"
    return "error", f"{stage}: {type(exc).__name__}: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:400] + ("..." if len(text) > 400 else "")


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
    rtol = RTOL[prog.family]
    f_rev, holder = build(prog)
    f_plain, holder_plain = build(prog, plain=True)
    if _tied(prog):
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
                return "error", f"{stage}: {type(e).__name__}: {_first_line(e)}"
            return "wrong", f"{stage}: accepted a program that must be refused"
        return "refused", ""

    _guard(prog, ws, a, b)
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
            (_, outs), grads = _value_and_grad(rev, holder, ws, a, b)
        except revnet.NotInvertibleError as e:
            if round_ == 0:
                return (
                    "wrong",
                    f"refused a program that must be accepted: {_first_line(e)}",
                )
            return _accepted_then(e, stage + "grad")
        except Exception as e:  # noqa: BLE001
            return _accepted_then(e, stage + "grad")
        try:
            (_, want_outs), want = _value_and_grad(f_plain, holder_plain, ws, a, b)
            compare(outs, want_outs, rtol, stage + "values")
            if eager:
                compare(values, tuple(want_outs), rtol, stage + "eager values")
            compare(grads, want, rtol, stage + "grads (weights, a, b)")
            if prog.family in HALF:
                _check_half_reference(
                    prog, f_plain, holder_plain, ws, a, b, outs, grads, want_outs, want
                )
            if not _tied(prog):
                # inverse() is given outputs only, so it makes decisions again
                # on rebuilt values; a near-tie there may flip.
                back = revnet.inverse(f_rev, a, b)(want_outs)
                compare(tuple(back), (a, b), rtol, stage + "inverse")
        except Exception as e:  # noqa: BLE001
            return _accepted_then(e, stage.rstrip(": ") or "check")
    return "accepted", ""


def _check_half_reference(prog, f, holder, ws, a, b, outs, grads, want_outs, want):
    up = functools.partial(jax.tree_util.tree_map, lambda x: x.astype(jnp.float32))
    (_, ref_outs), ref = _value_and_grad(f, holder, up(ws), up(a), up(b))
    holder["ws"] = ws
    tol = RTOL[prog.family]
    compare_to_reference(up(outs), up(want_outs), ref_outs, tol, "values vs float32")
    compare_to_reference(up(grads), up(want), ref, tol, "grads vs float32")


def _check_static(prog: Program, invertible) -> tuple[str, str]:
    del invertible  # the module-level STATIC_INVERTIBLE is under test
    rtol = RTOL[prog.family]
    f, holder = build(prog)
    ws, a, b = materialise(prog)
    holder["ws"] = ws
    s1, s2 = (
        float(v)
        for v in np.random.default_rng([prog.seed, prog.index, 5]).choice(
            [0.5, 2.0, -1.0, 3.0], 2, replace=False
        )
    )
    _guard(prog, ws, a, b, s1)
    CTX.update(f=f, holder=holder)
    token = (prog.seed, prog.index)
    try:
        wants = {}
        for s in (s1, s2):
            wants[s] = static_step(ws, a, b, s, token, False)
        if _all_zero(
            jax.tree_util.tree_map(lambda x, y: x - y, wants[s1][1], wants[s2][1])
        ):
            raise Redraw("static_jit: the gradients do not depend on s")
        for stage, s in [("jit s1", s1), ("jit s2", s2), ("jit s1 again", s1)]:
            try:
                (_, outs), grads = static_step(ws, a, b, s, token, True)
            except revnet.NotInvertibleError as e:
                if stage == "jit s1":
                    return (
                        "wrong",
                        f"refused a program that must be accepted: {_first_line(e)}",
                    )
                return _accepted_then(e, stage)
            except Exception as e:  # noqa: BLE001
                return _accepted_then(e, stage)
            try:
                compare(outs, wants[s][0][1], rtol, f"{stage} (s={s}) values")
                compare(grads, wants[s][1], rtol, f"{stage} (s={s}) grads")
            except Exception as e:  # noqa: BLE001
                return _accepted_then(e, stage)
        for stage, s in [("eager s1", s1), ("eager s2", s2)]:
            try:
                holder["s"] = s
                (_, outs), grads = _value_and_grad(STATIC_INVERTIBLE, holder, ws, a, b)
                compare(grads, wants[s][1], rtol, f"{stage} (s={s}) grads")
                if not _tied(prog):  # see _check
                    back = revnet.inverse(STATIC_INVERTIBLE, a, b)(outs)
                    compare(tuple(back), (a, b), rtol, f"{stage} inverse")
            except Exception as e:  # noqa: BLE001
                return _accepted_then(e, stage)
    finally:
        CTX.clear()
    return "accepted", ""


# --------------------------------------------------------------------------- #
# Runs, counts and reports.

COLUMNS = ("tried", "accepted", "refused", "raised", "wrong")


@dataclasses.dataclass
class Failure:
    """A wrong program: its outcome, message and (shrunk) source."""

    construct: str
    outcome: str
    message: str
    describe: str
    source: str


@dataclasses.dataclass
class Report:
    """Counts per construct (and ``"all"``), failures, redraws and timing."""

    counts: dict = dataclasses.field(
        default_factory=lambda: collections.defaultdict(collections.Counter)
    )
    failures: list = dataclasses.field(default_factory=list)
    redrawn: int = 0
    seconds: float = 0.0
    cpu: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    @property
    def total(self) -> collections.Counter:
        return self.counts["all"]

    def featured(self, name: str) -> int:
        """How many programs were drawn for construct ``name`` (featuring it)."""
        return self.cpu[name + "#n"]

    def add(self, prog: Program, outcome: str):
        """Counts one program in the rows of its constructs and in ``"all"``."""
        for row in [*sorted(prog.constructs), "all"]:
            c = self.counts[row]
            c["tried"] += 1
            c["refused" if outcome == "refused" else "accepted"] += 1
            c["raised"] += outcome == "error"
            c["wrong"] += outcome in ("error", "wrong")

    def merge(self, other: Report):
        for row, c in other.counts.items():
            self.counts[row].update(c)
        self.failures += other.failures
        self.redrawn += other.redrawn
        self.cpu.update(other.cpu)
        self.seconds = max(self.seconds, other.seconds)

    def table(self, timing: bool = False) -> str:
        """The counts table, one row per construct.

        Args:
          timing: add the mean CPU milliseconds of the programs drawn for each
            construct (its ``featured`` programs, redraws included).
        """
        rows = [r for r in CONSTRUCTS if r in self.counts] + ["all"]
        cols = COLUMNS + (("ms",) if timing else ())
        head = f"{'construct':<24}" + "".join(f"{c:>10}" for c in cols)
        lines = [head, "-" * len(head)]
        for r in rows:
            c = self.counts[r]
            line = f"{r:<24}" + "".join(f"{c[k]:>10}" for k in COLUMNS)
            if timing:
                n = self.cpu[r + "#n"]
                line += f"{1000 * self.cpu[r] / n:>10.0f}" if n else f"{'':>10}"
            lines.append(line)
        t = self.total
        lines.append(
            f"{t['tried']} programs in {self.seconds:.1f} s "
            f"({1000 * self.seconds / max(t['tried'], 1):.1f} ms each); "
            f"{self.redrawn} draws redrawn (ill-conditioned or vacuous)"
        )
        return "\n".join(lines)

    def failures_text(self, per_construct: int = 2, source: bool = True) -> str:
        """The first failures of each construct, with message and source."""
        seen: collections.Counter = collections.Counter()
        out = []
        for f in self.failures:
            seen[f.construct] += 1
            if seen[f.construct] > per_construct:
                continue
            out.append(f"[{f.outcome}] {f.construct}: {f.describe}\n  {f.message}")
            if source and f.source:
                out.append(textwrap.indent(f.source, "    "))
        more = len(self.failures) - sum(min(n, per_construct) for n in seen.values())
        if more > 0:
            out.append(f"... and {more} more failures")
        return "\n".join(out)


def _recheck(prog: Program, invertible) -> str:
    try:
        return check_program(prog, invertible)[1]
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {_first_line(e)}"


def shrink(prog: Program, outcome: str, invertible=revnet.invertible, budget: int = 12):
    """Removes ops one at a time while the program still fails the same way."""
    ops = list(prog.ops)
    i = 0
    while i < len(ops) and budget > 0 and len(ops) > 1:
        trial = dataclasses.replace(prog, ops=ops[:i] + ops[i + 1 :])
        if trial.expect != prog.expect or (
            prog.featured in CONSTRUCTS
            and CONSTRUCTS[prog.featured].op
            and prog.featured not in trial.constructs
        ):
            i += 1
            continue
        budget -= 1
        try:
            got, _ = check_program(trial, invertible)
        except Exception:  # noqa: BLE001  (ill-conditioned, or a checker crash)
            got = None
        if got == outcome:
            ops = trial.ops
        else:
            i += 1
    return prog if len(ops) == len(prog.ops) else dataclasses.replace(prog, ops=ops)


def run(
    programs: int,
    seed: int = 0,
    only: Iterable[str] | None = None,
    disable: Iterable[str] = (),
    shrink_failures: int = 2,
    invertible=revnet.invertible,
    start: int = 0,
    log: Callable[[str], None] | None = None,
    min_featured: int = MIN_FEATURED,
    feature_weights: dict[str, float] | None = None,
) -> Report:
    """Draws and checks ``programs`` random programs.

    Args:
      programs: how many programs to count (ill-conditioned draws are redrawn).
      seed: the run's seed.
      only: the constructs to enable (all when None).
      disable: constructs to switch off.
      shrink_failures: shrink the first this-many failures of each construct.
      invertible: the decorator under test.
      start: index of the first program (to split a run into chunks).
      log: called with a line for each failure, when given.
      min_featured: draw the first ``min_featured * len(enabled)`` programs for
        each enabled construct in turn (then at random, by
        :data:`FEATURE_WEIGHTS`).
      feature_weights: overrides of :data:`FEATURE_WEIGHTS`.

    Returns:
      The report.
    """
    enabled = [n for n in CONSTRUCTS if (only is None or n in set(only))]
    enabled = [n for n in enabled if n not in set(disable)]
    unknown = set(only or ()) | set(disable)
    if unknown - set(CONSTRUCTS):
        raise ValueError(f"unknown constructs: {sorted(unknown - set(CONSTRUCTS))}")
    report = Report()
    t0 = time.perf_counter()
    shrunk: collections.Counter = collections.Counter()
    index = start
    for k in range(programs):
        featured = (
            enabled[k % len(enabled)] if k < min_featured * len(enabled) else None
        )
        t = time.process_time()
        while True:
            prog = draw_program(seed, index, enabled, featured, feature_weights)
            index += 1
            try:
                outcome, message = check_program(prog, invertible)
                break
            except Redraw:
                report.redrawn += 1
            except Exception as e:  # noqa: BLE001  (a crash of the checker itself)
                outcome = "error"
                message = f"checker: {type(e).__name__}: {_first_line(e)}"
                message += "\n" + traceback.format_exc(limit=-3)
                break
        report.add(prog, outcome)
        report.cpu[prog.featured] += time.process_time() - t
        report.cpu[prog.featured + "#n"] += 1
        report.cpu["all"] += time.process_time() - t
        report.cpu["all#n"] += 1
        if outcome in ("error", "wrong"):
            small = prog
            if shrunk[prog.featured] < shrink_failures:
                shrunk[prog.featured] += 1
                small = shrink(prog, outcome, invertible)
                if small is not prog:
                    message = _recheck(small, invertible) or message
            failure = Failure(
                prog.featured,
                outcome,
                message,
                small.describe(),
                small.source(scan="revnet.scan"),
            )
            report.failures.append(failure)
            if log:
                log(f"[{outcome}] {small.describe()}\n  {message}")
    report.seconds = time.perf_counter() - t0
    return report


def _run_chunk(args):
    programs, seed, only, disable, start = args
    return run(programs, seed, only, disable, start=start)


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m tests.fuzz --programs N --seed S``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--programs", type=int, default=2000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--jobs", type=int, default=1, help="worker processes")
    p.add_argument("--only", default="", help="comma-separated constructs")
    p.add_argument("--disable", default="", help="comma-separated constructs")
    p.add_argument("--failures", type=int, default=2, help="shown per construct")
    p.add_argument("--verbose", action="store_true", help="print failures as found")
    p.add_argument("--list", action="store_true", help="list the constructs")
    p.add_argument("--timing", action="store_true", help="CPU ms per construct")
    ns = p.parse_args(argv)
    if ns.list:
        for c in CONSTRUCTS.values():
            print(f"{c.name:<24} must {c.expect:<7} families {','.join(c.families)}")
        return 0
    only = [s for s in ns.only.split(",") if s] or None
    disable = [s for s in ns.disable.split(",") if s]
    t0 = time.perf_counter()
    if ns.jobs <= 1:
        log = (lambda s: print(s, flush=True)) if ns.verbose else None
        report = run(ns.programs, ns.seed, only, disable, log=log)
    else:
        per = -(-ns.programs // ns.jobs)
        # Far-apart program indices per chunk: chunks never draw the same program.
        chunks = [
            (min(per, ns.programs - j * per), ns.seed, only, disable, j * 10 * per)
            for j in range(ns.jobs)
            if ns.programs > j * per
        ]
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(len(chunks)) as pool:
            report = Report()
            for part in pool.imap_unordered(_run_chunk, chunks):
                report.merge(part)
    report.seconds = time.perf_counter() - t0
    print(report.table(ns.timing))
    if report.failures:
        print("\nFailures (first of each construct, shrunk):")
        print(report.failures_text(ns.failures))
    return 1 if report.total["wrong"] else 0
