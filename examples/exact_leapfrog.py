"""A bit-reversible leapfrog of a learned potential, differentiated in flat memory.

A few particles move in the plane under a learned potential ``V(q) = |q|^2/2 +
MLP(q)`` (summed over particles; the force is ``-grad_q V``, taken with
``jax.grad`` inside the step). Each kick-drift-kick step is three exact
updates (``revnet.exact.add``) on the grid ``2**-bits``: the momentum and the
positions only ever move by a rounded increment computed from the other
variable, so the step is undone bit for bit. The loss is the final positions'
distance to a target after ``--steps`` steps of ``revnet.scan(...,
mode="invert")``, whose backward pass rebuilds every state by running the
step backwards, so memory does not depend on the number of steps. The example

1. rebuilds the initial state from the final one with ``revnet.inverse`` of
   the whole loop: bit for bit with exact updates, and with a nonzero error
   for the same leapfrog in plain float32;
2. compares the gradient with ``jax.lax.scan`` autodiff of the same quantised
   step: equal to float32 rounding, not bit for bit (the backward passes are
   different programs); it prints the largest difference relative to each
   leaf's largest entry;
3. prints the compiled temp memory of ``jit(grad(loss))`` at 1,000 and
   100,000 steps (compiled, not run), and takes a few normalised gradient steps.

    python examples/exact_leapfrog.py                 # 100,000 steps
    python examples/exact_leapfrog.py --smoke         # 10,000 steps, seconds
    python examples/exact_leapfrog.py --out runs/lf   # writes exact_leapfrog.json

``--smoke`` runs 10,000 steps instead of 100,000 (to stay within seconds on two
CPU cores) and one update; the memory is still compiled at both step counts.
With plain float32 steps (``bits`` None in :func:`step`) the same rebuild
misses by about ``1e-5``. ``--bits`` above 20 is refused: the positions and
momenta must stay below ``2**(24 - bits)`` for the sums to be exact.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # _flags, _durable, revnet from a checkout

import _flags  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; a bad one ends the program with one line (exit status 2)."""
    parser = _flags.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--smoke", action="store_true", help="10,000 steps, one update")
    add("--steps", type=_flags.positive_int, default=None, help="default 100,000")
    add("--bits", type=_flags.positive_int, default=16, help="the grid is 2**-bits")
    add("--out", type=_flags.writable_dir, help="writes DIR/exact_leapfrog.json")
    add("--seed", type=_flags.non_negative_int, default=0)
    args = parser.parse_args(argv)
    _flags.at_most(parser, "--bits", args.bits, 20, "bits that leave |x| < 16")
    return args


if __name__ == "__main__":
    parse_args()  # bad flags end here, before the slow imports below

import _durable  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import revnet  # noqa: E402
from revnet import exact  # noqa: E402

DT, PARTICLES, WIDTH, LR = 0.01, 4, 16, 0.02
MEMORY_STEPS, LOOPS = (1_000, 100_000), ("revnet", "lax")


def init_mlp(key: jax.Array) -> dict:
    """The learned part of the potential: a 2-layer tanh MLP of one position."""
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (2, WIDTH)) / np.sqrt(2.0),
        "b1": jnp.zeros(WIDTH),
        "w2": 0.1 * jax.random.normal(k2, (WIDTH,)) / np.sqrt(WIDTH),
    }


def potential(params: dict, q: jax.Array) -> jax.Array:
    """``V(q)`` of all particles (``q`` of shape ``(PARTICLES, 2)``)."""
    h = jnp.tanh(q @ params["w1"] + params["b1"])
    return 0.5 * jnp.sum(q**2) + jnp.sum(h @ params["w2"])


def step(params: dict, bits: int | None):
    """One kick-drift-kick step of ``(q, p)``: exact on the grid ``2**-bits``,
    or plain float arithmetic when ``bits`` is None."""
    grad_v = jax.grad(potential, argnums=1)  # minus the force

    def add(x, d):
        return x + d if bits is None else exact.add(x, d, bits=bits)

    def body(carry, _):
        q, p = carry
        p = add(p, -0.5 * DT * grad_v(params, q))
        q = add(q, DT * p)
        p = add(p, -0.5 * DT * grad_v(params, q))
        return (q, p), None

    return body


def run(params, q0, p0, n: int, bits: int | None, loop: str = "revnet"):
    """``(q, p)`` after ``n`` steps, with ``revnet.scan`` or ``lax.scan``."""
    if loop == "lax":
        return jax.lax.scan(step(params, bits), (q0, p0), None, length=n)[0]
    body = step(params, bits)
    return revnet.scan(body, (q0, p0), None, length=n, mode="invert")[0]


def loss(params, q0, p0, target, n: int, bits: int, loop: str = "revnet"):
    """Squared distance of the final positions to ``target``."""
    q, _ = run(params, q0, p0, n, bits, loop)
    return jnp.sum((q - target) ** 2)


def rebuild(params, q0, p0, n: int, bits: int | None):
    """The initial state rebuilt from the final one by inverting the loop."""
    forward = jax.jit(lambda q, p: run(params, q, p, n, bits))
    inverse = jax.jit(revnet.inverse(forward, q0, p0))
    return inverse(forward(q0, p0))


def grad_fn(q0, p0, target, n: int, bits: int, loop: str = "revnet"):
    """``jit(grad(loss))`` with respect to the parameters."""
    return jax.jit(jax.grad(lambda w: loss(w, q0, p0, target, n, bits, loop)))


def temp_bytes(params, q0, p0, target, n: int, bits: int) -> int:
    """Compiled temp memory of ``jit(grad(loss))`` for ``n`` steps (not run)."""
    compiled = grad_fn(q0, p0, target, n, bits).lower(params).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    n = args.steps or (10_000 if args.smoke else 100_000)
    updates = 1 if args.smoke else 5
    kq, kp, kt, kw = jax.random.split(jax.random.PRNGKey(args.seed), 4)
    q0 = exact.grid(jax.random.normal(kq, (PARTICLES, 2)), bits=args.bits)
    p0 = exact.grid(jax.random.normal(kp, (PARTICLES, 2)), bits=args.bits)
    target = jax.random.normal(kt, (PARTICLES, 2))
    params = init_mlp(kw)
    print(f"{n:,} leapfrog steps of {PARTICLES} particles, grid 2**-{args.bits}")

    results = {"config": {"steps": n, "bits": args.bits, "smoke": args.smoke}}
    for name, bits in (("exact", args.bits), ("float", None)):
        q, p = rebuild(params, q0, p0, n, bits)
        same = bool(jnp.all(q == q0) & jnp.all(p == p0))
        err = float(jnp.maximum(jnp.max(jnp.abs(q - q0)), jnp.max(jnp.abs(p - p0))))
        results[f"{name}_rebuilt_bitwise"], results[f"{name}_rebuild_error"] = same, err
        print(
            f"{name:>5} leapfrog: initial state rebuilt bit for bit: {same}, "
            f"max |error| {err:.3e}"
        )

    grads = [grad_fn(q0, p0, target, n, args.bits, loop)(params) for loop in LOOPS]
    pairs = list(zip(*map(jax.tree.leaves, grads)))
    bitwise = all(bool(jnp.all(a == b)) for a, b in pairs)
    rel = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in pairs)
    results.update(grads_bitwise=bitwise, grads_max_rel_diff=rel)
    print(
        f"gradient, revnet.scan vs lax.scan: bit for bit {bitwise}, "
        f"max relative difference {rel:.2e}"
    )

    memory = {}
    for m in MEMORY_STEPS:
        memory[str(m)] = temp_bytes(params, q0, p0, target, m, args.bits)
        print(f"temp memory of jit(grad(loss)), {m:>7,} steps: {memory[str(m)]:,} B")
    results["temp_bytes"] = memory

    # Normalised gradient steps: over 100,000 steps the gradient is large.
    train = jax.jit(jax.value_and_grad(lambda w: loss(w, q0, p0, target, n, args.bits)))
    losses = []
    for i in range(updates):
        value, g = train(params)
        norm = jnp.sqrt(sum(jnp.sum(d**2) for d in jax.tree.leaves(g)))
        params = jax.tree.map(lambda w, d: w - LR * d / norm, params, g)
        losses.append(float(value))
        print(f"update {i}: loss {value:.4f}, |grad| {norm:.3g}")
    results["losses"] = losses
    if args.out:
        _durable.write_json(os.path.join(args.out, "exact_leapfrog.json"), results)
    return results


if __name__ == "__main__":
    try:
        main()
    except OSError as err:  # writing the results failed: one line, exit 1
        _flags.fail(err)
