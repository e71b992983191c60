"""A Glow on scikit-learn's digits, trained by maximum likelihood, two twins.

The flow: squeeze, a ``ReversibleSequence`` of Glow steps (ActNorm, the LU
1x1 convolution, an affine coupling with a small convolutional net), a
multi-scale split that sends half the channels to the base density, squeeze
and a second sequence. Its log-determinant is derived from the program
(``forward_and_log_det``); the reversible twin trains it in activation memory
flat in depth, the standard twin (``reversible=False``) with plain backprop,
from the same parameters on the same batches. It prints each twin's test bits
per dimension and compiled training-step memory, and draws samples to a PNG.

    python examples/flow_digits.py              # 2,000 steps, a few minutes
    python examples/flow_digits.py --smoke      # a few tiny steps, seconds
    python examples/flow_digits.py --out runs/f # runs/f/flow_digits.{json,png}
"""

from __future__ import annotations

import argparse
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # _flags, _state, revnet from a checkout

import _flags  # noqa: E402

N_TRAIN = 1797 - 360  # the digits less train_test_split's 20% (rounded up) for tests


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; a bad one ends the program with one line (exit status 2)."""
    parser = _flags.ArgumentParser(description=__doc__.splitlines()[0])
    add, count = parser.add_argument, _flags.positive_int
    add("--smoke", action="store_true", help="a few tiny steps")
    add("--steps", type=count, default=None, help="default 2000")
    add("--depth", type=count, default=None, help="steps per scale")
    add("--batch", type=count, default=64)
    add("--lr", type=_flags.finite_positive_float, default=1e-3, help="Adam")
    add("--seed", type=_flags.non_negative_int, default=0)
    add("--out", type=_flags.writable_dir, help="JSON and PNG go here")
    args = parser.parse_args(argv)
    _flags.at_most(parser, "--batch", args.batch, N_TRAIN, "training images")
    return args


if __name__ == "__main__":
    parse_args()  # bad flags end here, before the slow imports below

import _state  # noqa: E402
import haiku as hk  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

from revnet import blocks, flows  # noqa: E402

TWINS = ("reversible", "standard")
LEVELS = 17  # pixel values 0..16


def glow_step(h: jax.Array, hidden: int) -> jax.Array:
    """ActNorm, the 1x1 convolution, an affine coupling (zero-initialised)."""
    h = blocks.InvertibleConv1x1()(blocks.ActNorm()(h))
    net = hk.Sequential([hk.Conv2D(hidden, 3), jax.nn.relu, hk.Conv2D(h.shape[-1], 3)])
    return blocks.AffineCoupling(net)(h)


def stages(depth: int, hidden: int, reversible: bool):
    def seq(name):
        step = lambda h: glow_step(h, hidden)  # noqa: E731
        return blocks.ReversibleSequence(step, depth, reversible, name=name)

    return seq("scale_1"), seq("scale_2")


def log_prob(x, depth, hidden, reversible):
    """``log p(x)`` per example of the dequantised images ``x`` in [0, 1)."""
    first, second = stages(depth, hidden, reversible)
    h, ld1 = first.forward_and_log_det(flows.squeeze(x - 0.5))  # [b, 4, 4, 4]
    kept, z1 = flows.split(h)
    z2, ld2 = second.forward_and_log_det(flows.squeeze(kept))  # [b, 2, 2, 8]
    base = [flows.StandardNormal(z.shape[1:]) for z in (z1, z2)]
    return base[0].log_prob(z1) + base[1].log_prob(z2) + ld1 + ld2


def sample(key, n, depth, hidden):
    """Images drawn from the flow: the base's samples run backwards."""
    first, second = stages(depth, hidden, True)
    k1, k2 = jax.random.split(key)
    z1 = flows.StandardNormal((4, 4, 2)).sample(k1, (n,))
    z2 = flows.StandardNormal((2, 2, 8)).sample(k2, (n,))
    kept = flows.unsqueeze(second.inverse(z2))
    return flows.unsqueeze(first.inverse(flows.merge(kept, z1))) + 0.5


def bits_per_dim(log_px: jax.Array, dims: int) -> jax.Array:
    """Of the discrete pixels: ``-log p(x) / D + log 17``, in bits."""
    return (-log_px / dims + math.log(LEVELS)) / math.log(2.0)


def save_grid(images: np.ndarray, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = int(math.sqrt(len(images)))
    grid = images[: n * n, ..., 0].reshape(n, n, 8, 8).transpose(0, 2, 1, 3)
    plt.imsave(path, np.clip(grid.reshape(n * 8, n * 8), 0, 1), cmap="gray_r")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    steps = args.steps or (3 if args.smoke else 2000)
    depth = args.depth or (2 if args.smoke else 8)
    hidden = 8 if args.smoke else 32

    data = load_digits()
    images = data.images[..., None].astype(np.float32)  # [n, 8, 8, 1], 0..16
    x_tr, x_te = train_test_split(images, test_size=0.2, random_state=0)
    dims = int(np.prod(x_tr.shape[1:]))
    rng = np.random.default_rng(args.seed)

    def dequantised(x):
        return (x + rng.uniform(size=x.shape).astype(np.float32)) / LEVELS

    nets = {
        t: hk.transform(lambda x, r=(t == "reversible"): log_prob(x, depth, hidden, r))
        for t in TWINS
    }
    first = dequantised(x_tr[: args.batch])
    params = nets["reversible"].init(jax.random.PRNGKey(args.seed), first)
    optimiser = optax.adam(args.lr)

    def step(net):
        def loss(params, x):
            return jnp.mean(bits_per_dim(net.apply(params, None, x), dims))

        def update(params, opt_state, x):
            value, grads = jax.value_and_grad(loss)(params, x)
            updates, opt_state = optimiser.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        return jax.jit(update).lower(params, optimiser.init(params), first).compile()

    updates = {t: step(nets[t]) for t in TWINS}
    temp = {t: int(updates[t].memory_analysis().temp_size_in_bytes) for t in TWINS}
    for t in TWINS:
        print(f"{t}: compiled step temp memory {temp[t] / 2**20:.3f} MiB")
    twins = {t: (params, optimiser.init(params)) for t in TWINS}
    for i in range(1, steps + 1):
        idx = rng.choice(len(x_tr), args.batch, replace=False)
        x = dequantised(x_tr[idx])
        for t in TWINS:
            p, o, value = updates[t](*twins[t], x)
            twins[t] = (p, o)
        if i % max(1, steps // 10) == 0 or i == steps:
            print(f"step {i}: train bits/dim {float(value):.4f} (standard)", flush=True)
    test = dequantised(x_te)
    bpd = {
        t: float(jnp.mean(bits_per_dim(nets[t].apply(twins[t][0], None, test), dims)))
        for t in TWINS
    }
    print(
        f"test bits/dim: {bpd['reversible']:.4f} (reversible), "
        f"{bpd['standard']:.4f} (standard); memory "
        f"{temp['reversible'] / temp['standard']:.2f}x of the standard twin's"
    )
    results = {"steps": steps, "depth": depth, "bits_per_dim": bpd, "temp_bytes": temp}
    draw = hk.transform(lambda k: sample(k, 64, depth, hidden))
    drawn = np.asarray(draw.apply(twins["reversible"][0], None, jax.random.key(1)))
    results["samples_finite"] = bool(np.isfinite(drawn).all())
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        save_grid(drawn, os.path.join(args.out, "flow_digits.png"))
        _state.write_json(os.path.join(args.out, "flow_digits.json"), results)
    return results


if __name__ == "__main__":
    try:
        main()
    except OSError as err:  # writing the results failed: one line, exit 1
        _flags.fail(err)
