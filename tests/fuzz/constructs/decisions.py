"""Decisions and kinks on tied inputs: comparisons, ``rem``, bucketing,
quantisation, reductions and clamps, at the top level or nested in a loop, a
checkpoint, a branch or a custom rule (op generators as in
:mod:`tests.fuzz.constructs.basic`).
"""

from collections.abc import Callable

import jax.numpy as jnp


def decision(g, x, y):
    """A decision on ``y`` steering the update of ``x``.

    Programs with a decision start from quantised streams (halves in
    ``[-1.5, 1.5]``, see :func:`~tests.fuzz.programs.materialise`), so the
    decision's inputs hold exact ties (zeros, half-integers, equal entries of a
    row) where the backward pass rebuilds them with rounding error: a stored
    decision must be used there, never made again.
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


# The constructs below start from tied inputs too (see
# :data:`~tests.fuzz.constructs.TIED`): each reads ``y`` where the forward values
# sit exactly on a threshold, a multiple or a bucket edge, so the same operation
# evaluated on rebuilt values may land on the other side.


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


def nested_decision(g, x, y):
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


def rem(g, x, y):
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


def bucketing(g, x, y):
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


def reduce_precision(g, x, y):
    """``lax.reduce_precision`` (fake FP8 quantisation) on a tie."""
    fmt = g.pick(["e4m3", "e5m2", "e8m7", "e5m10"])
    e, m = int(fmt[1]), int(fmt[3:])
    bits = f"exponent_bits={e}, mantissa_bits={m}"
    ste, lines = _quantised(
        g, x, y, lambda u: f"jax.lax.reduce_precision({u}, {bits})", m
    )
    return f"{fmt}:{ste}", lines


def cast_round_trip(g, x, y):
    """A narrowing cast and back, written in F (quantisation-aware training)."""
    bits = {"bfloat16": 7, "float16": 10}
    if g.dtypes[y] == jnp.float64:
        bits["float32"] = 23
    to = g.pick(list(bits))
    ste, lines = _quantised(
        g, x, y, lambda u: f"{u}.astype(jnp.{to}).astype({u}.dtype)", bits[to]
    )
    return f"{to}:{ste}", lines


def reduction_kink(g, x, y):
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


def clamp_kink(g, x, y):
    """A clamp of ``y`` whose bounds are ties (``relu6``, ``hard_tanh`` too)."""
    variants = {
        # lax.clamp wants its bounds in the operand's dtype (a float16 stream
        # after a narrowing cast, with float32 literals, is a TypeError).
        "clamp": f"jax.lax.clamp(jnp.asarray(-0.5, {y}.dtype), {y}, "
        f"jnp.asarray(1.0, {y}.dtype))",
        "clip": f"jnp.clip({y}, -1.0, 0.5)",
        "relu6": f"jax.nn.relu6({y} * 4.0 + 2.0)",
        "hard_tanh": f"jax.nn.hard_tanh({y})",
    }
    name = g.pick(list(variants))
    t = f"jnp.tanh({y} @ {g.w((g.d, g.d))})"
    return name, [f"{x} = {x} + {variants[name]} * {t} * {g.c()}"]


def nan_guard(g, x, y):
    """A NaN guard of a value of ``y`` that is NaN only at a tie (``0/0``
    where ``y == 0``, a constant elsewhere): a decision, which must be stored.

    Guards over a region (``sqrt(y**3)``, NaN for every negative ``y``) and
    of a singular value (``1/y``) are left out: at their edge a rebuilt value
    on the other side differentiates the unselected branch, NaN or infinite,
    which plain JAX does too for a value inside the region (the documented
    "double where" pitfall), not a fault of the inversion.
    """
    n = g.n
    t = f"jnp.tanh({y} @ {g.w((g.d, g.d))})"
    variants = {
        "isnan_0_over_0": [f"u{n} = {y} / jnp.where({y} == 0, 0.0, {y})"],
        "isnan_2y_over_y": [f"u{n} = (2.0 * {y}) / jnp.where({y} == 0, 0.0, {y})"],
    }
    variants = {
        k: [*v, f"v{n} = jnp.where(jnp.isnan(u{n}), 0.0, u{n})"]
        for k, v in variants.items()
    }
    name = g.pick(list(variants))
    # ``y`` is then updated from ``x``, and ``x`` from ``y``: the backward
    # pass rebuilds ``x`` with rounding, then ``y`` by subtracting a term of
    # it, so ``y``'s exact zeros come back off zero (0 + s - s alone is 0).
    back = [
        f"{y} = {y} + jnp.tanh({x} @ {g.w((g.d, g.d))}) * {g.c()}",
        f"{x} = {x} + jnp.sin({y} @ {g.w((g.d, g.d))}) * {g.c()}",
    ]
    return name, [*variants[name], f"{x} = {x} + v{n} * {t} * {g.c()}", *back]
