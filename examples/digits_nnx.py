"""Trains a reversible NNX network on scikit-learn's digits, next to its twin.

The model is a user's own NNX block, an additive coupling whose residual
functions hold a BatchNorm, a LayerNorm and dropout, stacked with
``revnet.nnx.ReversibleSequence``. The standard twin is the same module with
``reversible=False``: same parameters (same ``nnx.Rngs`` seed), same batches,
same dropout streams. Both train with ``nnx.Optimizer`` and optax; every step
prints both losses and their gap, and each twin's compiled training step's
temp memory (``memory_analysis().temp_size_in_bytes``) is printed once.

    python examples/digits_nnx.py              # 200 steps
    python examples/digits_nnx.py --steps 50
    python examples/digits_nnx.py --smoke      # a few tiny steps, seconds
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # _flags, and revnet from a checkout

import _flags  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; a bad one ends the program with one line (exit status 2)."""
    parser = _flags.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=_flags.positive_int, default=200)
    parser.add_argument("--depth", type=_flags.positive_int, default=8)
    parser.add_argument("--smoke", action="store_true", help="a few tiny steps")
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # bad flags end here, before the slow imports below

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import revnet.nnx  # noqa: E402

TWINS = ("reversible", "standard")


class Block(nnx.Module):
    """``y1 = x1 + f(x2)``, ``y2 = x2 + g(y1)``, written by hand."""

    def __init__(self, width: int, rate: float, *, rngs: nnx.Rngs):
        half = width // 2
        self.f = nnx.Sequential(
            nnx.Linear(half, half, rngs=rngs),
            nnx.BatchNorm(half, rngs=rngs),
            jax.nn.relu,
            nnx.Dropout(rate, rngs=rngs),
        )
        self.g = nnx.Sequential(
            nnx.Linear(half, half, rngs=rngs),
            nnx.LayerNorm(half, rngs=rngs),
            jnp.tanh,
            nnx.Dropout(rate, rngs=rngs),
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        x1, x2 = jnp.split(x, 2, axis=-1)
        y1 = x1 + self.f(x2)
        return jnp.concatenate([y1, x2 + self.g(y1)], axis=-1)


class Classifier(nnx.Module):
    """Embedding, ``depth`` reversible blocks, linear read-out."""

    def __init__(self, depth, width, rate, *, reversible, rngs):
        self.embed = nnx.Linear(64, width, rngs=rngs)
        self.blocks = revnet.nnx.ReversibleSequence(
            lambda rngs: Block(width, rate, rngs=rngs),
            depth,
            rngs=rngs,
            reversible=reversible,
        )
        self.head = nnx.Linear(width, 10, rngs=rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        return self.head(self.blocks(self.embed(images)))


def loss_fn(model: Classifier, images, labels) -> jax.Array:
    logits = model(images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@nnx.jit
def train_step(model, optimizer, images, labels):
    """One optax step; BatchNorm statistics and dropout streams advance once."""
    loss, grads = nnx.value_and_grad(loss_fn)(model, images, labels)
    optimizer.update(model, grads)
    return loss


def batches(steps: int, batch: int, seed: int = 0):
    """``steps`` shuffled batches of the digits, scaled to [0, 1]."""
    data = load_digits()
    images = (data.data / 16.0).astype(np.float32)
    labels = data.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(labels))
    for step in range(steps):
        idx = np.take(order, np.arange(step * batch, (step + 1) * batch), mode="wrap")
        yield jnp.asarray(images[idx]), jnp.asarray(labels[idx])


def build(reversible: bool, depth: int, width: int, rate: float, lr: float):
    model = Classifier(depth, width, rate, reversible=reversible, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)


def temp_bytes(model, optimizer, images, labels) -> int:
    """Temp memory XLA plans for one compiled training step."""
    compiled = train_step.lower(model, optimizer, images, labels).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def train(
    steps: int,
    *,
    depth: int = 8,
    width: int = 64,
    batch: int = 128,
    rate: float = 0.1,
    lr: float = 1e-3,
    verbose: bool = False,
) -> dict[str, list[float]]:
    """Trains both twins on the same batches; returns each one's losses."""
    twins = {t: build(t == "reversible", depth, width, rate, lr) for t in TWINS}
    losses = {t: [] for t in TWINS}
    for step, (images, labels) in enumerate(batches(steps, batch)):
        if step == 0 and verbose:
            for twin, (model, opt) in twins.items():
                mib = temp_bytes(model, opt, images, labels) / 2**20
                print(f"{twin:>10}: compiled training step temp memory {mib:.2f} MiB")
        for twin, (model, opt) in twins.items():
            losses[twin].append(float(train_step(model, opt, images, labels)))
        if verbose:
            rev, std = (losses[t][-1] for t in TWINS)
            print(f"step {step:4d}  loss {rev:.6f} / {std:.6f}  gap {rev - std:+.1e}")
    return losses


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    args = parse_args(argv)
    if args.smoke:
        losses = train(3, depth=2, width=16, batch=32, verbose=True)
    else:
        losses = train(args.steps, depth=args.depth, verbose=True)
    gap = max(abs(r - s) for r, s in zip(*losses.values()))
    print(f"largest loss gap over {len(losses['reversible'])} steps: {gap:.1e}")
    return losses


if __name__ == "__main__":
    main()
