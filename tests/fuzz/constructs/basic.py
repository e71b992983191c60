"""The basic constructs: invertible ops, custom rules, nested and static
``jit``s, the information-losing ops that must be refused, casts and duplicated
slices.

Each op generator takes the generation state ``g`` and the names of the stream
it updates (``x``) and the one it reads (``y``), and returns ``(variant,
lines)``: the variant drawn and the source lines of the op.
"""

import jax.numpy as jnp

from tests.fuzz.constructs.generator import Gen
from tests.fuzz.families import DTYPE_SRC, HALF


def unary(g: Gen, x: str, y: str):
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


def coupling(g, x, y):
    if g.rng.uniform() < 0.15:  # a dot_general with a batch dimension
        w = g.w((g.batch, g.d, g.d))
        product = f'jnp.einsum("bi,bij->bj", {y}, {w})'
        return "batched_dot", [f"{x} = {x} + jnp.tanh({product}) * {g.c()}"]
    return "tanh", [f"{x} = {x} + jnp.tanh({y} @ {g.w((g.d, g.d))}) * {g.c()}"]


def mix(g, x, y):
    return "relu", [f"{x} = {x} - jax.nn.relu({y}) * {g.c()}"]


def halves(g, x, y):
    h, n = g.d // 2, g.n
    return "concat", [
        f"lo{n}, hi{n} = {x}[..., :{h}], {x}[..., {h}:]",
        f"{x} = jnp.concatenate([hi{n}, lo{n} * {g.c(1.1, 2.0)}], -1)",
    ]


def _eye_plus(g, w):
    return f"(jnp.eye({g.d}, dtype={w}.dtype) + {w} * 0.1)"


def dot(g, x, y):
    variant = g.pick(["right", "left", "known_matrix"])
    if variant == "known_matrix":  # the weight is the matrix: eye + noise
        m = g.w((g.d, g.d), "eye")
    else:
        m = _eye_plus(g, g.w((g.d, g.d)))
    if variant == "left":
        return variant, [f"{x} = ({m} @ {x}.T).T"]
    return variant, [f"{x} = {x} @ {m}"]


def custom_vjp(g, x, y):
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


def custom_jvp(g, x, y):
    variant = g.pick(["ste_scale", "ste_sinh", "ste_asinh", "ste_in_branch"])
    if variant == "ste_in_branch":
        return variant, [f"{x} = {x} + ste_sinh({y}) * {g.c()}"]
    return variant, [f"{x} = {variant}({x})"]


def nested_jit(g, x, y):
    variant = g.pick(["mul", "dot", "coupling"])
    if variant == "mul":
        w = g.w((g.d,), "positive")
        return variant, [f"{x} = jax.jit(lambda z: z * {w})({x})"]
    if variant == "dot":
        m = _eye_plus(g, g.w((g.d, g.d)))
        return variant, [f"{x} = jax.jit(lambda z: z @ {m})({x})"]
    w = g.w((g.d, g.d))
    return variant, [f"{x} = jax.jit(lambda z: z + jnp.tanh({y} @ {w}) * {g.c()})({x})"]


def static_jit(g, x, y):
    variant = g.pick(["nondiff_argnums", "closure"])
    if variant == "closure":
        return variant, [f'{x} = grad_scaler(holder["s"])({x}) * 2.0']
    return variant, [f'{x} = grad_scale(holder["s"], {x}) * 2.0']


def zero_literal(g, x, y):
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


def batch_stats(g, x, y):
    """A stateful block's training-mode step inside F: ``y`` normalised by
    its batch statistics (BatchNorm), then a coupling update of ``x``."""
    eps = g.pick(["1e-3", "1e-5"])
    normed = f"({y} - jnp.mean({y}, 0)) / jnp.sqrt(jnp.var({y}, 0) + {eps})"
    return "in_f", [f"{x} = {x} + jnp.tanh({normed} @ {g.w((g.d, g.d))}) * {g.c()}"]


def batch_norm_stream(g, x, y):
    """BatchNorm in training mode on the stream itself: its batch statistics
    are lost, so it is refused."""
    eps = g.pick(["1e-3", "1e-5"])
    scale = f"jnp.sqrt(jnp.var({x}, 0) + {eps})"
    if g.rng.uniform() < 0.5:
        return "normalise", [f"{x} = ({x} - jnp.mean({x}, 0)) / {scale}"]
    return "centre", [f"{x} = {x} - jnp.mean({x}, 0, keepdims=True)"]


def narrowing_cast(g, x, y):
    src = g.dtypes[x]  # the family's dtype: refused programs never widen
    narrower = [jnp.float16, jnp.bfloat16]
    if src == jnp.float64:
        narrower.append(jnp.float32)
    to = jnp.dtype(g.pick(narrower))
    if g.rng.uniform() < 0.5:  # a detour back to the original dtype
        line = f"{x} = {x}.astype({DTYPE_SRC[to]}).astype({DTYPE_SRC[src]})"
        return f"detour_{to.name}", [line]
    g.dtypes[x] = to
    return f"to_{to.name}", [f"{x} = {x}.astype({DTYPE_SRC[to]})"]


def widening_cast(g, x, y):
    to = jnp.float64 if g.dtypes[x] == jnp.float32 else jnp.float32
    g.dtypes[x] = jnp.dtype(to)
    return f"to_{jnp.dtype(to).name}", [f"{x} = {x}.astype({DTYPE_SRC[g.dtypes[x]]})"]


def dup_slices(g, x, y):
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
