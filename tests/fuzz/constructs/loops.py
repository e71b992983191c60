"""Loops: ``revnet.scan`` and ``lax.scan`` with unused outputs, nested scans
and ``fori_loop`` (op generators as in :mod:`tests.fuzz.constructs.basic`).
"""


def _scan_body(g, name, ys):
    return [
        f"def {name}(c, v):",
        "    p, q = c",
        f"    p = p + jnp.tanh(q @ v) * {g.c()}",
        f"    q = q - jnp.tanh(p @ v.T) * {g.c()}",
        f"    return (p, q), {ys}",
    ]


def scan_unused_ys(scan: str):
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


def nested_revnet_scan(g, x, y):
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


def fori_loop(g, x, y):
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
