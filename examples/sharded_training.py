"""Trains a reversible transformer on a 2-D ("data", "model") device mesh.

Parameters are sharded FSDP-style over ``data`` and tensor-parallel over
``model`` (attention heads, the MLP's hidden width) by partition rules; the
residual stream is sharded over ``data``. The task is synthetic: predict the
next token of sequences that count up modulo the vocabulary size.

    python examples/sharded_training.py --devices 8            # 8 CPU devices
    python examples/sharded_training.py --smoke --devices 8    # a few steps
    python examples/sharded_training.py --explicit ...         # Explicit axes
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
    add("--devices", type=count, default=8, help="forced CPU devices")
    add("--data", type=count, default=4, help="size of the data axis")
    add("--steps", type=count, default=200)
    add("--layers", type=count, default=8)
    add("--batch", type=count, default=32)
    add("--explicit", action="store_true", help="Explicit mesh axes")
    add("--smoke", action="store_true", help="a few tiny steps")
    args = parser.parse_args(argv)
    if args.devices % args.data or (not args.smoke and args.batch % args.data):
        parser.error(f"--data {args.data} must divide --devices and --batch")
    return args


ARGS = parse_args()
# Forced CPU devices must be asked for before JAX starts its backend.
if ARGS.devices > 1:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={ARGS.devices}"
    )
    # XLA:CPU's pool of max(cores, devices) threads can deadlock a collective
    # on a small machine; twice the devices cannot (docs/guides/scaling.md).
    os.environ.setdefault("PJRT_NPROC", str(2 * ARGS.devices))
import haiku as hk  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from revnet import blocks  # noqa: E402

VOCAB, TIME = 32, 16
MODEL, MLP, HEADS = (32, 64, 2) if ARGS.smoke else (64, 256, 4)
LAYERS = 2 if ARGS.smoke else ARGS.layers
# Logical axes of blocks.TRANSFORMER_RULES -> mesh axes. The rules end with
# (".*", ()): the embedding and the unembedding, plain Haiku outside the
# encoder's layers, are replicated (an Explicit mesh refuses a product that
# contracts an axis sharded on one side only).
AXES = {"embed": "data", "heads": "model", "mlp": "model"}
RULES = blocks.TRANSFORMER_RULES


class TrainingState(NamedTuple):
    params: hk.Params
    opt_state: optax.OptState


def net_fn(tokens: jax.Array) -> jax.Array:
    """Next-token logits ``[batch, time, vocab]``."""
    # A one-hot product rather than hk.Embed's lookup: an Explicit mesh asks a
    # gather from a batch sharded over "data" for its output sharding.
    h = hk.Linear(MODEL, with_bias=False, name="embed")(jax.nn.one_hot(tokens, VOCAB))
    h = h + hk.get_parameter("position", [TIME, MODEL], init=jnp.zeros)
    h = blocks.ReversibleTransformer(
        LAYERS, HEADS, MODEL, MLP, activation_sharding=P("data")
    )(h, is_training=True)
    return hk.Linear(VOCAB, name="unembed")(h)


network = hk.transform(net_fn)
optimiser = optax.adam(3e-3)


def loss(params: hk.Params, tokens: jax.Array) -> jax.Array:
    """Cross-entropy of predicting each next token."""
    logits = network.apply(params, None, tokens[:, :-1])
    labels = jax.nn.one_hot(tokens[:, 1:], VOCAB)
    return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), axis=-1))


@jax.jit
def update(state: TrainingState, tokens: jax.Array) -> tuple[TrainingState, jax.Array]:
    """One step of Adam; the gradient's backward pass rebuilds activations."""
    value, grads = jax.value_and_grad(loss)(state.params, tokens)
    updates, opt_state = optimiser.update(grads, state.opt_state)
    return TrainingState(optax.apply_updates(state.params, updates), opt_state), value


def batches(rng: np.random.Generator, batch: int):
    """Sequences ``start, start + 1, ...`` modulo ``VOCAB``, one more than TIME."""
    while True:
        start = rng.integers(0, VOCAB, (batch, 1))
        yield (start + np.arange(TIME + 1)) % VOCAB


def make_mesh(devices: int, data: int, explicit: bool) -> jax.sharding.Mesh:
    shape, names = (data, devices // data), ("data", "model")
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(shape, names, axis_types=(kind, kind))


def main() -> None:
    mesh = make_mesh(jax.device_count(), ARGS.data, ARGS.explicit)
    print(f"mesh {dict(mesh.shape)}, axes {mesh.axis_types}")
    data = batches(np.random.default_rng(0), 8 if ARGS.smoke else ARGS.batch)
    with jax.set_mesh(mesh):
        tokens = next(data)
        params = jax.jit(network.init)(jax.random.key(0), tokens[:, :-1])
        shardings = blocks.partition(params, mesh, RULES, axes=AXES)
        params = jax.device_put(params, shardings)
        state = TrainingState(params, optimiser.init(params))
        batch_sharding = NamedSharding(mesh, P("data"))
        for step in range(5 if ARGS.smoke else ARGS.steps):
            tokens = jax.device_put(next(data), batch_sharding)
            state, value = update(state, tokens)
            print(f"step {step} loss {float(value):.4f}")
    path = "reversible_transformer/~/layers/~/layers/additive_coupling/~/g/linear"
    w = state.params[path]["w"]
    print(f"an MLP weight {w.shape} is placed as {w.sharding.spec}")


if __name__ == "__main__":
    main()
