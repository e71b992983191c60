"""Trains a small RevNet on scikit-learn's digits, reversible and standard twins.

Both twins start from the same parameters (one ``init``), see the same batches
in the same order and step with the same optax optimiser; they differ only in
``reversible``. Three comparisons are logged at every step:

* **lock-step**: the standard twin's loss and gradients evaluated on the
  reversible twin's current parameters and BatchNorm state (the same inputs),
  against the reversible twin's own loss and gradients: the direct statement
  that the reversible backward pass computes what backprop computes;
* **free-running**: each twin following its own trajectory;
* **control**: the standard twin against itself started from parameters
  multiplied by ``1 + 1e-7 * noise`` (float32 rounding size). Free-running
  twins differ by float32 rounding in every step; if the control drifts apart
  as far as the free-running twins do, the drift is the training dynamics
  amplifying rounding noise, not a difference between the twins.

Also reported: test accuracy, the step-time ratio (the twins alternate step by
step, so they share the machine's drifting load) and each twin's compiled
training-step memory. Training is data-parallel over all visible devices (a
``Mesh`` with one ``data`` axis: the batch is split, parameters replicated), the
jitted step donates parameter and optimiser buffers, and an atomic checkpoint
after every epoch lets an interrupted run resume where it stopped.

The checkpoint, ``<out>/train_checkpoint.npz``, holds every twin's parameters,
BatchNorm state and optimiser state, the epoch and step counters, the
configuration's hash and the history so far (``checkpoint.save_checkpoint``: an
``.npz`` with a JSON manifest and a SHA-256 checksum, loaded without pickle).
The one it replaces is kept as ``train_checkpoint.prev.npz``. A checkpoint that
fails its checksum (or does not parse) is reported in one line on stderr and
the run resumes from the previous one, or from scratch. The batch order of an
epoch depends only on the seed and the epoch, so a resumed run repeats exactly
what an uninterrupted one computes.

Run ``python -m experiments.train --help`` for the flags.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

from experiments import checkpoint, common

DESCRIPTION = __doc__.split("\n\n")[0]
TWINS = ("reversible", "standard")
CONTROL_EPS = 1e-7  # relative perturbation of the control run's parameters
CHECKPOINT = "train_checkpoint.npz"
PREVIOUS_CHECKPOINT = "train_checkpoint.prev.npz"
LEGACY_CHECKPOINT = "train_checkpoint.pkl"  # pickle format: never loaded


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = common.make_parser("python -m experiments.train", DESCRIPTION)
    parser.add_argument("--epochs", type=common.positive_int, default=None)
    parser.add_argument(
        "--batch",
        type=common.positive_int,
        default=64,
        help="global batch, split over the devices (default: 64)",
    )
    parser.add_argument(
        "--lr",
        type=common.positive_float,
        default=0.05,
        help="peak learning rate of SGD with momentum 0.9: one epoch of linear "
        "warm-up, then cosine decay to 0 (default: 0.05)",
    )
    parser.add_argument(
        "--units",
        type=common.int_list,
        default=None,
        help="reversible units per stage (default: 2,2; 1,1 with --tiny)",
    )
    parser.add_argument(
        "--width",
        type=common.even_int,
        default=16,
        help="first stage width, even: each coupling splits it into halves "
        "(default: 16)",
    )
    parser.add_argument("--seed", type=common.seed_int, default=0)
    parser.add_argument(
        "--no-control",
        dest="control",
        action="store_false",
        help="skip the control run (the standard twin from parameters perturbed "
        "by 1e-7 relative)",
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="ignore an existing checkpoint and start from scratch",
    )
    parser.add_argument(
        "--stop-after",
        type=common.positive_int,
        default=None,
        help="stop after this many epochs of THIS run (simulates an interruption; "
        "rerun to resume)",
    )
    parser.add_argument(
        "--anchor-every",
        type=common.positive_int,
        default=None,
        help="store the reversible twin's activations every this many units of "
        "each stage (anchors; default: none)",
    )
    parser.add_argument(
        "--save-grads",
        action="store_true",
        help="also write <out>/train_grads.npz, the first step's gradients",
    )
    return parser


def load_digits_split(seed: int) -> dict[str, Any]:
    """Digits as NHWC float32 images in [0, 1], split 80/20 (stratified)."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    images = (data.images / 16.0).astype(np.float32)[..., None]
    labels = data.target.astype(np.int32)
    x_tr, x_te, y_tr, y_te = train_test_split(
        images, labels, test_size=0.2, random_state=seed, stratify=labels
    )
    return {"x_train": x_tr, "y_train": y_tr, "x_test": x_te, "y_test": y_te}


def _config_hash(config: dict[str, Any]) -> str:
    keys = ("epochs", "batch", "lr", "units", "width", "seed", "num_devices")
    keys += ("control",)
    # Anchors change only rounding, but a resumed run must not mix the two.
    extra = {"anchor_every": config["anchor_every"]} if config["anchor_every"] else {}
    text = json.dumps({**{k: config[k] for k in keys}, **extra}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _problem(path: str, reason: str | None) -> str:
    """How ``resume_point`` describes a checkpoint it cannot use."""
    if reason is None:
        return f"{path} is missing"
    if reason == "config":
        return f"{path} was written for a different configuration"
    return f"{path} is corrupt ({reason})"


def resume_point(
    out: str, make_template: Callable[[], Any], config_hash: str
) -> tuple[Any, dict[str, Any] | None, bool]:
    """Finds the newest usable checkpoint in ``out``.

    Tries ``CHECKPOINT``, then ``PREVIOUS_CHECKPOINT``. A file is usable if it
    passes its checksum, parses, has the structure of ``make_template()`` and
    was written with ``config_hash``. If a file exists but is not usable, ONE
    line on stderr says which, why, and where the run goes on from.

    Args:
      out: The output folder.
      make_template: Returns a pytree with the saved tree's structure, shapes
        and dtypes; called only if a checkpoint file exists.
      config_hash: The run's configuration hash.

    Returns:
      ``(tree, meta, latest_ok)``: the checkpoint's tree and metadata, or
      ``(None, None, ...)`` to start from scratch; ``latest_ok`` tells whether
      ``CHECKPOINT`` itself was usable (only then may the next save move it to
      ``PREVIOUS_CHECKPOINT``).
    """
    latest = os.path.join(out, CHECKPOINT)
    previous = os.path.join(out, PREVIOUS_CHECKPOINT)
    problems: list[tuple[str, str | None]] = []
    template = None
    for path in (latest, previous):
        if not os.path.exists(path):
            problems.append((path, None))
            continue
        if template is None:
            template = make_template()
        try:
            tree, meta = checkpoint.load_checkpoint(path, template)
        except FileNotFoundError:  # removed since os.path.exists
            problems.append((path, None))
            continue
        except checkpoint.CheckpointError as err:
            problems.append((path, str(err) or "unreadable"))
            continue
        if meta.get("config_hash") != config_hash:
            problems.append((path, "config"))
            continue
        if problems:  # the latest was unusable, the previous one is good
            print(
                f"train: checkpoint {_problem(*problems[0])}; resuming from the "
                f"previous checkpoint {path} (epoch {meta.get('epoch')})",
                file=sys.stderr,
                flush=True,
            )
        return tree, meta, not problems
    (_, latest_reason), (_, previous_reason) = problems
    if previous_reason is not None:
        print(
            f"train: checkpoint {_problem(*problems[0])} and the previous "
            f"checkpoint {_problem(*problems[1])}; starting from scratch",
            file=sys.stderr,
            flush=True,
        )
    elif latest_reason is not None:
        print(
            f"train: checkpoint {_problem(*problems[0])}; starting from scratch",
            file=sys.stderr,
            flush=True,
        )
    elif os.path.exists(os.path.join(out, LEGACY_CHECKPOINT)):
        print(
            f"train: ignoring {os.path.join(out, LEGACY_CHECKPOINT)} (the old "
            "pickle format, which is never loaded); starting from scratch",
            file=sys.stderr,
            flush=True,
        )
    return None, None, False


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Trains both twins and returns the results (see the module docstring)."""
    import haiku as hk
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from tqdm import tqdm

    from revnet.blocks import RevNet, RevNetConfig

    devices = jax.devices()
    n_dev = len(devices)
    if args.batch % n_dev:  # main() checks this; run() may be called directly
        raise ValueError(f"batch {args.batch} is not divisible by {n_dev} devices")
    mesh = Mesh(np.array(devices), ("data",))
    replicated = NamedSharding(mesh, P())
    split = NamedSharding(mesh, P("data"))

    width = args.width
    units = tuple(args.units)
    channels = (width, width) + tuple(
        width * 2 ** (i + 1) for i in range(len(units) - 1)
    )
    net_config = RevNetConfig(units=units, channels=channels)
    data = load_digits_split(args.seed)
    steps_per_epoch = len(data["x_train"]) // args.batch
    if steps_per_epoch < 1:  # main() checks this; run() may be called directly
        raise ValueError(f"batch {args.batch} exceeds the training set")

    def make(reversible: bool):
        def forward(x, is_training):
            anchors = args.anchor_every if reversible else None
            return RevNet(
                net_config, num_classes=10, reversible=reversible, anchor_every=anchors
            )(x, is_training)

        return hk.transform_with_state(forward)

    nets = {twin: make(twin == "reversible") for twin in TWINS}
    # SGD with momentum is linear in the gradients, so float32 rounding noise
    # between the twins stays noise-sized. (Adam divides by the root of the
    # second moment: parameters whose true gradient is zero, such as conv
    # biases that feed a BatchNorm, would take full-sized steps in the
    # direction of the noise and the twins' curves would drift apart.)
    total_steps = args.epochs * steps_per_epoch
    warmup = steps_per_epoch if args.epochs > 1 else max(1, steps_per_epoch // 2)
    # The cosine needs at least one step after the warm-up (one epoch of one
    # step: no warm-up).
    warmup = min(warmup, total_steps - 1)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, total_steps)
    optimizer = optax.sgd(schedule, momentum=0.9)

    def make_step(net):
        def loss_fn(params, state, x, y):
            logits, state = net.apply(params, state, None, x, True)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return loss, state

        def step(params, state, opt_state, x, y):
            (loss, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                params, state, x, y
            )
            updates, opt_state = optimizer.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            # The gradients come back too, for the lock-step comparison.
            return new_params, state, opt_state, loss, grads

        def grads_fn(params, state, x, y):
            return jax.grad(loss_fn, has_aux=True)(params, state, x, y)[0]

        def value_and_grads(params, state, x, y):
            (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                params, state, x, y
            )
            return loss, grads

        jitted = jax.jit(
            step,
            donate_argnums=(0, 1, 2),
            in_shardings=(replicated, replicated, replicated, split, split),
            out_shardings=(replicated,) * 5,
        )
        # Not donated: evaluates the other twin's parameters, which live on.
        evaluate = jax.jit(
            value_and_grads,
            in_shardings=(replicated, replicated, split, split),
            out_shardings=(replicated, replicated),
        )
        return jitted, grads_fn, evaluate

    @jax.jit
    def grad_difference(a, b):
        """``(|a - b| / |b|, max_i |a_i - b_i| / max_i |b_i|)`` over the tree."""
        diff = jax.tree.map(lambda u, v: u - v, a, b)
        norm = lambda t: jnp.sqrt(  # noqa: E731
            sum(jnp.sum(jnp.square(leaf)) for leaf in jax.tree.leaves(t))
        )
        amax = lambda t: jnp.max(  # noqa: E731
            jnp.stack([jnp.max(jnp.abs(leaf)) for leaf in jax.tree.leaves(t)])
        )
        return norm(diff) / norm(b), amax(diff) / amax(b)

    def make_eval(net):
        @jax.jit
        def logits(params, state, x):
            return net.apply(params, state, None, x, False)[0]

        return logits

    steps = {twin: make_step(nets[twin]) for twin in TWINS}
    evals = {twin: make_eval(nets[twin]) for twin in TWINS}

    config = {
        "epochs": args.epochs,
        "batch": args.batch,
        "lr": args.lr,
        "units": list(units),
        "width": width,
        "seed": args.seed,
        "num_devices": n_dev,
        "control": args.control,
        "anchor_every": args.anchor_every,
    }
    config_hash = _config_hash(config)
    ckpt_path = os.path.join(args.out, CHECKPOINT)
    x0 = jnp.asarray(data["x_train"][: args.batch])
    twins_saved = TWINS + (("control",) if args.control else ())

    def template() -> dict[str, Any]:
        """The saved tree's structure, shapes and dtypes (nothing computed)."""
        params, state = jax.eval_shape(
            lambda key, x: nets["standard"].init(key, x, True),
            jax.random.PRNGKey(args.seed),
            x0,
        )
        tree = (params, state, jax.eval_shape(optimizer.init, params))
        return {"trees": {twin: tree for twin in twins_saved}}

    ckpt, meta, latest_ok = (
        (None, None, False)
        if args.fresh
        else resume_point(args.out, template, config_hash)
    )
    if ckpt is None:
        params, state = common.init_unoptimised(
            nets["standard"].init,
            jax.random.PRNGKey(args.seed),
            x0,
            True,
            static_argnums=(2,),
        )
        opt_init = jax.jit(optimizer.init)
        opt_state = opt_init(params)
        trees = {twin: (params, state, opt_state) for twin in TWINS}
        if args.control:
            # Host-side noise (no device compiles): p * (1 + 1e-7 * N(0, 1)),
            # rounded to float32, i.e. about one float32 ulp per parameter.
            rng = np.random.RandomState(args.seed + 7919)
            perturbed = jax.tree.map(
                lambda a: jnp.asarray(
                    (
                        np.asarray(a, np.float64)
                        * (1 + CONTROL_EPS * rng.standard_normal(a.shape))
                    ).astype(a.dtype)
                ),
                params,
            )
            trees["control"] = (perturbed, state, opt_init(perturbed))
        start_epoch = 0
        history: dict[str, Any] = {
            "step": [],
            "loss": {t: [] for t in TWINS},
            "step_time_s": {t: [] for t in TWINS},
            "epoch_test_accuracy": {t: [] for t in TWINS},
            "lockstep": {"loss_standard": [], "grad_rel_diff": [], "grad_max_diff": []},
            "control_loss": [],
        }
    else:
        trees = ckpt["trees"]
        start_epoch = int(meta["epoch"])
        history = meta["history"]
    # Fresh replicated copies per twin (the steps donate their inputs).
    trees = {
        twin: jax.tree.map(lambda a: jax.device_put(jnp.array(a), replicated), tree)
        for twin, tree in trees.items()
    }

    def accuracy(twin: str) -> float:
        params, state, _ = trees[twin]
        net = "standard" if twin == "control" else twin
        logits = evals[net](params, state, jnp.asarray(data["x_test"]))
        return float(np.mean(np.argmax(np.asarray(logits), -1) == data["y_test"]))

    if args.save_grads and start_epoch == 0:
        params, state, _ = trees["reversible"]
        xb = jax.device_put(jnp.asarray(data["x_train"][: args.batch]), split)
        yb = jax.device_put(jnp.asarray(data["y_train"][: args.batch]), split)
        grads = {twin: jax.jit(steps[twin][1])(params, state, xb, yb) for twin in TWINS}
        flat = {
            f"{twin}/{'/'.join(str(k.key) for k in path)}": np.asarray(leaf)
            for twin in TWINS
            for path, leaf in jax.tree_util.tree_flatten_with_path(grads[twin])[0]
        }
        buf_path = os.path.join(args.out, "train_grads.npz")
        with open(buf_path + ".tmp", "wb") as f:
            np.savez(f, **flat)
        os.replace(buf_path + ".tmp", buf_path)

    memory = {}
    run_step: dict[str, Any] = {}
    for twin in TWINS:
        params, state, opt_state = trees[twin]
        xb = jax.ShapeDtypeStruct((args.batch, 8, 8, 1), jnp.float32, sharding=split)
        yb = jax.ShapeDtypeStruct((args.batch,), jnp.int32, sharding=split)
        compiled = steps[twin][0].lower(params, state, opt_state, xb, yb).compile()
        run_step[twin] = compiled  # train with what was measured (one compile)
        mem = compiled.memory_analysis()
        memory[twin] = {
            "temp_bytes": float(mem.temp_size_in_bytes),
            "argument_bytes": float(mem.argument_size_in_bytes),
        }

    total = (args.epochs - start_epoch) * steps_per_epoch
    stop_epoch = args.epochs
    if args.stop_after is not None:
        stop_epoch = min(args.epochs, start_epoch + args.stop_after)
    bar = tqdm(total=total, desc="train (both twins)", unit="step", mininterval=1.0)
    for epoch in range(start_epoch, stop_epoch):
        order = np.random.RandomState(args.seed + epoch).permutation(
            len(data["x_train"])
        )
        for i in range(steps_per_epoch):
            idx = order[i * args.batch : (i + 1) * args.batch]
            xb = jax.device_put(jnp.asarray(data["x_train"][idx]), split)
            yb = jax.device_put(jnp.asarray(data["y_train"][idx]), split)
            # Lock-step: the standard twin on the reversible twin's parameters
            # and state, before the reversible step consumes (donates) them.
            params, state, _ = trees["reversible"]
            lock_loss, lock_grads = steps["standard"][2](params, state, xb, yb)
            grads = {}
            # Alternate which twin goes first, so neither always runs warm.
            for twin in TWINS if i % 2 == 0 else TWINS[::-1]:
                start = time.perf_counter()
                *tree, loss, grads[twin] = run_step[twin](*trees[twin], xb, yb)
                loss = float(loss)  # blocks until the step is done
                history["step_time_s"][twin].append(time.perf_counter() - start)
                trees[twin] = tuple(tree)
                history["loss"][twin].append(loss)
            rel, worst = grad_difference(grads["reversible"], lock_grads)
            history["lockstep"]["loss_standard"].append(float(lock_loss))
            history["lockstep"]["grad_rel_diff"].append(float(rel))
            history["lockstep"]["grad_max_diff"].append(float(worst))
            if "control" in trees:
                *tree, loss, _ = run_step["standard"](*trees["control"], xb, yb)
                trees["control"] = tuple(tree)
                history["control_loss"].append(float(loss))
            history["step"].append(epoch * steps_per_epoch + i)
            bar.update(1)
        for twin in TWINS:
            history["epoch_test_accuracy"][twin].append(accuracy(twin))
        if "control" in trees:
            history.setdefault("control_test_accuracy", []).append(accuracy("control"))
        bar.set_postfix(
            epoch=epoch + 1,
            acc="/".join(f"{history['epoch_test_accuracy'][t][-1]:.3f}" for t in TWINS),
        )
        previous = os.path.join(args.out, PREVIOUS_CHECKPOINT)
        checkpoint.save_checkpoint(
            ckpt_path,
            {"trees": jax.device_get(trees)},
            {
                "config_hash": config_hash,
                "epoch": epoch + 1,
                "step": (epoch + 1) * steps_per_epoch,
                "history": history,
            },
            # Keep the one it replaces, unless that one was found unusable or
            # is ignored (--fresh).
            previous=previous if latest_ok else None,
        )
        if args.fresh and not latest_ok and os.path.exists(previous):
            os.unlink(previous)  # from before --fresh: never resume from it
        latest_ok = True
    bar.close()
    finished = stop_epoch == args.epochs

    losses = {t: np.asarray(history["loss"][t]) for t in TWINS}
    diff = np.abs(losses["reversible"] - losses["standard"])
    lock = history["lockstep"]
    lock_diff = np.abs(losses["reversible"] - np.asarray(lock["loss_standard"]))
    control = np.asarray(history["control_loss"])
    control_diff = np.abs(control - losses["standard"]) if control.size else None

    def first_over(d: Any, threshold: float = 1e-3) -> int | None:
        if d is None or not (d > threshold).any():
            return None
        return int(np.argmax(d > threshold))

    # Step times: drop the first epoch's first steps (compilation, warm-up).
    warm = min(5, max(0, len(history["step"]) - 1))
    times = {t: np.asarray(history["step_time_s"][t][warm:]) for t in TWINS}
    ratio = times["reversible"] / np.maximum(times["standard"], 1e-12)
    return {
        "config": {**config, "channels": list(channels), "config_hash": config_hash},
        "finished": finished,
        "resumed_from_epoch": start_epoch,
        "epochs_done": stop_epoch,
        "steps_per_epoch": steps_per_epoch,
        "num_devices": n_dev,
        "train_size": len(data["x_train"]),
        "test_size": len(data["x_test"]),
        "history": history,
        # Lock-step (same parameters and state at every step): the must-hold.
        "lockstep": {
            "loss_max_abs_diff": float(lock_diff.max()) if lock_diff.size else None,
            "grad_rel_diff_max": max(lock["grad_rel_diff"], default=None),
            "grad_rel_diff_median": float(np.median(lock["grad_rel_diff"]))
            if lock["grad_rel_diff"]
            else None,
            "grad_max_diff_max": max(lock["grad_max_diff"], default=None),
            "steps": int(lock_diff.size),
        },
        # Free-running twins, each on its own trajectory.
        "loss_max_abs_diff": float(diff.max()) if diff.size else None,
        "first_step_over_1e-3": first_over(diff),
        "free_running_first_epoch_max_abs_diff": float(diff[:steps_per_epoch].max())
        if diff.size
        else None,
        # The control: the standard twin against itself, 1e-7 apart at step 0.
        "control": {
            "relative_perturbation": CONTROL_EPS,
            "loss_max_abs_diff": float(control_diff.max())
            if control_diff is not None
            else None,
            "first_step_over_1e-3": first_over(control_diff),
            "first_epoch_max_abs_diff": float(control_diff[:steps_per_epoch].max())
            if control_diff is not None
            else None,
            "test_accuracy": (history.get("control_test_accuracy") or [None])[-1],
        }
        if args.control
        else None,
        "final_loss": {t: float(losses[t][-1]) for t in TWINS if losses[t].size},
        "test_accuracy": {
            t: history["epoch_test_accuracy"][t][-1]
            for t in TWINS
            if history["epoch_test_accuracy"][t]
        },
        "step_time": {
            **{
                t: {
                    "median_s": float(np.median(times[t])),
                    "min_s": float(times[t].min()),
                    "max_s": float(times[t].max()),
                }
                for t in TWINS
                if times[t].size
            },
            "ratio_reversible_over_standard": {
                "median": float(np.median(ratio)),
                "min": float(ratio.min()),
                "max": float(ratio.max()),
                "pairs": int(ratio.size),
            }
            if ratio.size
            else None,
        },
        "compiled_step_memory": memory,
        "process_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        / 1024,
    }


def plot(results: dict[str, Any], out: str) -> str:
    """Writes ``<out>/train.png``: both loss curves, their difference, accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    hist = results["history"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for twin, style in zip(TWINS, ("-", "--"), strict=True):
        axes[0].plot(hist["step"], hist["loss"][twin], style, label=twin)
    axes[0].set(xlabel="step", ylabel="training loss", yscale="log")
    axes[0].set_title("digits: loss of both twins")
    rev = np.asarray(hist["loss"]["reversible"])
    curves = [
        ("free-running: |reversible - standard|", hist["loss"]["standard"], "-"),
        ("lock-step (same parameters)", hist["lockstep"]["loss_standard"], "-"),
        (
            "control: |standard - standard(1+1e-7 noise)|",
            hist.get("control_loss") or [],
            ":",
        ),
    ]
    for label, other, style in curves:
        if len(other) != len(rev):
            continue
        ref = rev if label[0] != "c" else np.asarray(hist["loss"]["standard"])
        diff = np.abs(ref - np.asarray(other))
        axes[1].semilogy(hist["step"], np.maximum(diff, 1e-12), style, label=label)
    axes[1].axhline(1e-3, color="gray", ls="--", label="1e-3 requirement")
    axes[1].set(xlabel="step", ylabel="absolute loss difference")
    axes[1].set_title("loss differences (1e-12 = equal)")
    for twin, style in zip(TWINS, ("-o", "--s"), strict=True):
        acc = hist["epoch_test_accuracy"][twin]
        axes[2].plot(range(1, len(acc) + 1), acc, style, label=twin)
    axes[2].axhline(0.95, color="gray", ls="--", label="95%")
    axes[2].set(xlabel="epoch", ylabel="test accuracy")
    axes[2].set_title("digits: test accuracy")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    return common.save_figure(fig, out, "train")


def main(argv: list[str] | None = None) -> int:
    """Entry point: parses flags, trains, writes JSON and plot."""
    parser = build_parser()
    args = common.parse_args(parser, argv)
    if args.epochs is None:
        args.epochs = 2 if args.tiny else 8 if args.quick else 20
    if args.units is None:
        args.units = [1, 1] if args.tiny else [2, 2]
    train_size = len(load_digits_split(args.seed)["y_train"])
    if args.batch > train_size:
        parser.error(
            f"argument --batch: expected at most the {train_size} training "
            f"images, got {args.batch}"
        )
    import jax

    n_dev = jax.device_count()
    if args.batch % n_dev:
        parser.error(
            f"argument --batch: expected a multiple of the {n_dev} devices "
            f"(the batch is split over them), got {args.batch}"
        )
    results = run(args)
    config = {**vars(args), **results.pop("config")}
    common.write_json(args.out, "train", config, results)
    plot(results, args.out)
    print(
        f"[train] test accuracy {results['test_accuracy']}, lock-step loss max "
        f"|diff| {results['lockstep']['loss_max_abs_diff']:.2e}, free-running "
        f"{results['loss_max_abs_diff']:.2e}, control "
        f"{(results['control'] or {}).get('loss_max_abs_diff')}, "
        f"devices {results['num_devices']}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
