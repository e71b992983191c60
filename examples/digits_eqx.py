"""Trains an Equinox model with a reversible body on scikit-learn's digits.

The body is ``revnet.eqx.ReversibleSequence`` of the user's own block: an
additive coupling whose residual functions hold a BatchNorm (statistics over
the batch, in ``eqx.nn.State``) and dropout. Two twins start from the same
parameters and see the same batches and dropout keys in the same order; they
differ only in ``reversible``. Every step prints both losses and their gap:
the reversible backward pass rebuilds activations instead of storing them and
agrees with backprop to float32 rounding. Each twin's compiled training step's
temp memory (``memory_analysis().temp_size_in_bytes``) is printed once.

    python examples/digits_eqx.py              # 50 steps, depth 16
    python examples/digits_eqx.py --smoke      # 3 tiny steps, seconds
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # _flags, and revnet from a checkout

import _flags  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; a bad one ends the program with one line (exit status 2)."""
    parser = _flags.ArgumentParser(description=__doc__.splitlines()[0])
    add, count = parser.add_argument, _flags.positive_int
    add("--smoke", action="store_true", help="3 tiny steps")
    add("--steps", type=count, default=None, help="default 50")
    add("--depth", type=count, default=None, help="default 16")
    add("--width", type=count, default=32)
    add("--batch", type=count, default=64)
    add("--lr", type=_flags.finite_positive_float, default=1e-3, help="Adam")
    add("--seed", type=_flags.non_negative_int, default=0)
    args = parser.parse_args(argv)
    _flags.at_most(parser, "--batch", args.batch, 1797, "images")
    return args


if __name__ == "__main__":
    parse_args()  # bad flags end here, before the slow imports below

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import revnet.eqx  # noqa: E402

TWINS = ("reversible", "standard")


class Residual(eqx.Module):
    """BatchNorm, linear, tanh, dropout: one example of one half."""

    norm: eqx.nn.BatchNorm
    linear: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, size: int, *, key: jax.Array):
        self.norm = eqx.nn.BatchNorm(size, axis_name="batch", mode="ema")
        self.linear = eqx.nn.Linear(size, size, key=key)
        self.dropout = eqx.nn.Dropout(0.1)

    def __call__(self, h, state, *, key):
        u, state = self.norm(h, state)
        return self.dropout(jnp.tanh(self.linear(u)), key=key), state


def make_block(width: int):
    def make(key):
        kf, kg = jax.random.split(key)
        half = width // 2
        return revnet.eqx.AdditiveCoupling(
            Residual(half, key=kf), Residual(half, key=kg)
        )

    return make


class Classifier(eqx.Module):
    embed: eqx.nn.Linear
    body: revnet.eqx.ReversibleSequence
    head: eqx.nn.Linear

    def __init__(self, depth: int, width: int, reversible: bool, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Linear(64, width, key=k1)
        self.body = revnet.eqx.ReversibleSequence(
            make_block(width), depth, key=k2, reversible=reversible
        )
        self.head = eqx.nn.Linear(width, 10, key=k3)

    def __call__(self, images, state, *, key):
        h = jax.vmap(self.embed)(images)
        h, state = self.body(h, state, key=key)
        return jax.vmap(self.head)(h), state


class TrainingState(NamedTuple):
    model: Classifier
    state: eqx.nn.State  # BatchNorm statistics
    opt_state: optax.OptState


def loss(model, state, images, labels, key):
    """Mean softmax cross-entropy, and the new BatchNorm state."""
    logits, state = model(images, state, key=key)
    xent = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return xent.mean(), state


def make_step(optimiser):
    @eqx.filter_jit
    def step(ts: TrainingState, images, labels, key):
        """One optimiser step; the new training state and the batch loss."""
        grad_fn = eqx.filter_value_and_grad(loss, has_aux=True)
        (value, state), grads = grad_fn(ts.model, ts.state, images, labels, key)
        params = eqx.filter(ts.model, eqx.is_inexact_array)
        updates, opt_state = optimiser.update(grads, ts.opt_state, params)
        model = eqx.apply_updates(ts.model, updates)
        return TrainingState(model, state, opt_state), value

    return step


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    steps = args.steps or (3 if args.smoke else 50)
    depth = args.depth or (2 if args.smoke else 16)
    width = 8 if args.smoke else args.width

    data = load_digits()
    images = (data.images / 16.0).reshape(-1, 64).astype(np.float32)
    labels = data.target.astype(np.int32)

    optimiser = optax.adam(args.lr)
    step = make_step(optimiser)
    twins = {}
    for t in TWINS:
        model, state = eqx.nn.make_with_state(Classifier)(
            depth, width, t == "reversible", key=jax.random.key(args.seed)
        )
        opt_state = optimiser.init(eqx.filter(model, eqx.is_inexact_array))
        twins[t] = TrainingState(model, state, opt_state)
    batch = (images[: args.batch], labels[: args.batch], jax.random.key(0))
    # Compiled once each; eqx's Compiled holds JAX's program as `.compiled`.
    steps_fn = {t: step.lower(twins[t], *batch).compile() for t in TWINS}
    temp = {
        t: int(steps_fn[t].compiled.memory_analysis().temp_size_in_bytes) for t in TWINS
    }
    for t in TWINS:
        print(f"{t}: compiled step temp memory {temp[t] / 2**10:.1f} KiB")

    rng = np.random.default_rng(args.seed)
    keys = jax.random.split(jax.random.key(args.seed + 1), steps)
    history = []
    for i in range(steps):
        idx = rng.choice(len(images), args.batch, replace=False)
        losses = {}
        for t in TWINS:
            twins[t], value = steps_fn[t](twins[t], images[idx], labels[idx], keys[i])
            losses[t] = float(value)
        gap = abs(losses["reversible"] - losses["standard"])
        history.append({"step": i + 1, "loss": losses, "gap": gap})
        print(
            f"step {i + 1}: loss {losses['reversible']:.6f} (reversible) "
            f"{losses['standard']:.6f} (standard), gap {gap:.1e}",
            flush=True,
        )
    return {"temp_bytes": temp, "history": history}


if __name__ == "__main__":
    main()
