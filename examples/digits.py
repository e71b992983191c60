"""Trains a small RevNet on scikit-learn's digits, reversible and standard twins.

Both twins start from the same parameters and see the same batches in the same
order; they differ only in ``reversible``. Every epoch prints each twin's mean
training loss and test accuracy, and the largest difference between the twins'
gradients at the same parameters (the reversible twin's, on one batch): the
reversible backward pass rebuilds activations instead of storing them and
agrees with backprop to float32 rounding. Each twin's compiled training step's
temp memory (``memory_analysis().temp_size_in_bytes``) is printed once.

    python examples/digits.py                 # 10 epochs
    python examples/digits.py --smoke         # a few tiny steps, seconds
    python examples/digits.py --out runs/dg   # writes runs/dg/digits.json

With ``--out DIR`` the training state is saved in ``DIR/state`` after every
epoch (orbax-checkpoint, SHA-256-checked before it is read; see ``_state.py``),
and a rerun with the same ``--out`` continues where the last run stopped. A bad
flag ends it at once with one line (exit status 2), a failed save with one line
(exit status 1).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # _flags, _state, revnet from a checkout

import _flags  # noqa: E402

N_TRAIN = 1797 - 360  # the digits less train_test_split's 20% (rounded up) for tests


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; a bad one ends the program with one line (exit status 2)."""
    parser = _flags.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--smoke", action="store_true", help="a few tiny steps")
    add("--epochs", type=_flags.positive_int, default=None, help="default 10")
    add("--out", type=_flags.writable_dir, help="JSON and resumable state")
    add("--batch", type=_flags.positive_int, default=64)
    add("--lr", type=_flags.finite_positive_float, default=0.05, help="SGD+momentum")
    add("--seed", type=_flags.non_negative_int, default=0)
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

from revnet.blocks import RevNet, RevNetConfig  # noqa: E402

TWINS = ("reversible", "standard")


class TrainingState(NamedTuple):
    params: hk.Params
    state: hk.State  # BatchNorm statistics
    opt_state: optax.OptState


def net_fn(images: jax.Array, is_training: bool, config: RevNetConfig, rev: bool):
    """The logits of a RevNet; ``rev`` picks reversible or standard backprop."""
    return RevNet(config, num_classes=10, reversible=rev)(images, is_training)


def loss(net: hk.TransformedWithState, params, state, images, labels):
    """Mean softmax cross-entropy, and the new BatchNorm state."""
    logits, state = net.apply(params, state, None, images, True)
    xent = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return xent.mean(), state


def update(net, optimiser, ts: TrainingState, images, labels):
    """One SGD step; returns the new training state and the batch loss."""
    grad_fn = jax.value_and_grad(functools.partial(loss, net), has_aux=True)
    (value, state), grads = grad_fn(ts.params, ts.state, images, labels)
    updates, opt_state = optimiser.update(grads, ts.opt_state, ts.params)
    new = TrainingState(optax.apply_updates(ts.params, updates), state, opt_state)
    return new, value


def evaluate(net, ts: TrainingState, images, labels) -> jax.Array:
    """Test accuracy with the running BatchNorm statistics."""
    logits, _ = net.apply(ts.params, ts.state, None, images, False)
    return jnp.mean(jnp.argmax(logits, -1) == labels)


def gradient_gap(nets, ts: TrainingState, images, labels):
    """Largest |gradient difference| of the twins at ``ts``, and largest |grad|."""
    fns = [jax.grad(functools.partial(loss, nets[t]), has_aux=True) for t in TWINS]
    grads = [fn(ts.params, ts.state, images, labels)[0] for fn in fns]
    diff = jax.tree.map(lambda a, b: jnp.max(jnp.abs(a - b)), *grads)
    return jnp.max(jnp.stack(jax.tree.leaves(diff))), jnp.max(
        jnp.stack([jnp.max(jnp.abs(g)) for g in jax.tree.leaves(grads[1])])
    )


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    epochs = args.epochs or (2 if args.smoke else 10)
    units, width = ((1,), 8) if args.smoke else ((2, 2), 16)
    config = RevNetConfig(units, (width,) * 2 + tuple(2 * width for _ in units[1:]))
    run_config = {"smoke": args.smoke, "batch": args.batch, "lr": args.lr}
    run_config["seed"] = args.seed  # everything but --epochs and --out

    data = load_digits()
    images = (data.images / 16.0).astype(np.float32)[..., None]
    x_tr, x_te, y_tr, y_te = train_test_split(
        images, data.target.astype(np.int32), test_size=0.2, random_state=0
    )
    steps = min(3, len(x_tr) // args.batch) if args.smoke else len(x_tr) // args.batch

    nets = {
        t: hk.transform_with_state(
            functools.partial(net_fn, config=config, rev=t == "reversible")
        )
        for t in TWINS
    }
    optimiser = optax.sgd(args.lr, momentum=0.9)
    params, bn = nets["standard"].init(jax.random.PRNGKey(args.seed), x_tr[:2], True)
    fresh = TrainingState(params, bn, optimiser.init(params))
    twins = {t: fresh for t in TWINS}
    batch = (x_tr[: args.batch], y_tr[: args.batch])
    # Compiled once each; the compiled step's memory is the twin's figure.
    jits = {t: jax.jit(functools.partial(update, nets[t], optimiser)) for t in TWINS}
    steps_fn = {t: jits[t].lower(fresh, *batch).compile() for t in TWINS}
    temp = {t: int(steps_fn[t].memory_analysis().temp_size_in_bytes) for t in TWINS}
    evals = {t: jax.jit(functools.partial(evaluate, nets[t])) for t in TWINS}
    gap_fn = jax.jit(functools.partial(gradient_gap, nets))
    for t in TWINS:
        print(f"{t}: compiled step temp memory {temp[t] / 2**20:.3f} MiB")

    history, state_dir = [], args.out and os.path.join(args.out, "state")
    for step in reversed(_state.steps(state_dir) if state_dir else []):
        try:
            twins, meta = _state.load(state_dir, step, twins)
        except _state.StateError as err:
            print(f"digits: {err}; trying an older state", file=sys.stderr)
            continue
        if meta["config"] != run_config:
            _flags.fail(f"{state_dir} holds another configuration's run")
        history = meta["history"]
        print(f"resuming after epoch {len(history)} from {state_dir}")
        break
    for epoch in range(len(history) + 1, epochs + 1):
        order = np.random.default_rng([args.seed, epoch]).permutation(len(x_tr))
        losses = {t: [] for t in TWINS}
        for i in range(steps):
            idx = order[i * args.batch : (i + 1) * args.batch]
            for t in TWINS:
                twins[t], value = steps_fn[t](twins[t], x_tr[idx], y_tr[idx])
                losses[t].append(value)
        gap, scale = gap_fn(twins["reversible"], x_tr[idx], y_tr[idx])
        record = {
            "epoch": epoch,
            "loss": {t: float(np.mean(losses[t])) for t in TWINS},
            "test_accuracy": {t: float(evals[t](twins[t], x_te, y_te)) for t in TWINS},
            "grad_max_abs_diff": float(gap),
            "grad_max_abs": float(scale),
        }
        history.append(record)
        print(
            f"epoch {epoch}: loss {record['loss']['reversible']:.4f} (reversible) "
            f"{record['loss']['standard']:.4f} (standard), test accuracy "
            f"{record['test_accuracy']['reversible']:.3f} / "
            f"{record['test_accuracy']['standard']:.3f}, gradient max |diff| at "
            f"equal parameters {gap:.2e} (max |grad| {scale:.2e})",
            flush=True,
        )
        if state_dir:
            meta = {"config": run_config, "history": history}
            _state.save(state_dir, epoch, twins, meta)
    results = {"config": {**run_config, "epochs": epochs}, "temp_bytes": temp}
    results["history"] = history
    if args.out:
        _state.write_json(os.path.join(args.out, "digits.json"), results)
    return results


if __name__ == "__main__":
    try:
        main()
    except (_state.StateError, OSError) as err:  # saving failed: one line, exit 1
        _flags.fail(err)
