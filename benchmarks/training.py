"""Training: the digits twins and the leapfrog integrator, from ``examples/``.

Runs ``examples/digits.py`` (a RevNet on scikit-learn's digits, reversible and
standard twins from the same initialisation, with their gradient gap at equal
parameters) and ``examples/while_loop.py`` (a leapfrog integrator trained
through ``revnet.while_loop``, with compiled memory against ``lax.scan``), each
in its own process with ``--out``, collects their JSON and plots the loss
curves.

    python -m benchmarks.training [--out results] [--quick | --tiny]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

from benchmarks import measure

NAME = "train"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 2**20


def _run(script: str, flags: list[str]) -> None:
    """Runs ``examples/<script>.py`` with ``flags``; raises if it fails."""
    path = os.path.join(ROOT, "examples", f"{script}.py")
    subprocess.run([sys.executable, path, *flags], check=True)


def _plot(results: dict, out: str) -> dict[str, str]:
    """Writes the loss curves as PNGs under ``out``; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    names = {"digits": f"{NAME}_digits.png", "while_loop": f"{NAME}_while_loop.png"}
    history = results["digits"]["history"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    epochs = [r["epoch"] for r in history]
    for ax, key, log_y in ((ax1, "loss", True), (ax2, "test_accuracy", False)):
        twins = [
            {"label": twin, "x": epochs, "y": [r[key][twin] for r in history]}
            | {"marker": marker, "color": f"C{n}"}
            for n, (twin, marker) in enumerate((("reversible", "o"), ("standard", "x")))
        ]
        measure.plot_lines(ax, twins, log_y)  # the twins may coincide
    ax1.set(xlabel="epoch", ylabel="mean training loss", yscale="log")
    ax2.set(xlabel="epoch", ylabel="test accuracy")
    ax1.set_title("digits: training loss, twins from one init", fontsize=10)
    ax2.set_title("digits: test accuracy", fontsize=10)
    for ax in (ax1, ax2):  # whole epochs
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, names["digits"]), dpi=90)
    fig, ax = plt.subplots(figsize=(5, 3.6))
    ax.semilogy(results["while_loop"]["losses"])
    ax.set(xlabel="adam step", ylabel="MSE of final (q, p)")
    ax.set_title("leapfrog through revnet.while_loop: training loss", fontsize=10)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(os.path.join(out, names["while_loop"]), dpi=90)
    plt.close("all")
    return names


def main(argv: Sequence[str] | None = None) -> dict:
    """Runs both examples, writes ``<out>/train.json`` and the plots."""
    args = measure.parse(__doc__, argv)  # --tiny: the examples' --smoke
    work = os.path.join(args.out, NAME)
    digits = ["--smoke"] if args.tiny else ["--epochs", "4" if args.quick else "10"]
    loop = ["--smoke"] if args.tiny else ["--steps", "50" if args.quick else "200"]
    results = {"size": args.size}
    for script, flags in (("digits", digits), ("while_loop", loop)):
        folder = os.path.join(work, script)  # fresh: digits would resume
        shutil.rmtree(folder, ignore_errors=True)
        _run(script, [*flags, "--out", folder])
        with open(os.path.join(folder, f"{script}.json")) as f:
            results[script] = json.load(f)
    results["figures"] = _plot(results, args.out)
    tmp = os.path.join(args.out, f"{NAME}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(args.out, f"{NAME}.json"))
    return results


def markdown(results: dict, out: str) -> str:
    """The REPORT.md section; figures are referenced relative to ``out``."""
    digits, loop = results["digits"], results["while_loop"]
    last = digits["history"][-1]
    config = digits["config"]
    smoke = config.get("smoke")  # --tiny: a few steps of a toy network
    sizes = "units (1,), width 8, 3 steps an epoch" if smoke else "units (2, 2)"
    lines = [
        "## Training" + (": smoke run, not a result" if smoke else ""),
        "",
        "`examples/digits.py`: a RevNet on scikit-learn's digits, trained as a",
        "reversible and a standard twin from the same initialisation. The gradient",
        "gap is the largest |difference| of the twins' gradients at the same",
        "(the reversible twin's) parameters, on one batch per epoch. Sizes:",
        f"{sizes}, batch {config['batch']}, {config['epochs']} epochs.",
        "",
    ]
    if smoke:
        lines += [
            "**Smoke run, not a result** (`--tiny` runs the examples' `--smoke`):",
            "losses, accuracies and their plot are left out; only the gradient",
            "gap is shown.",
            "",
            "| epoch | gradient max abs diff | max abs gradient |",
            "|---|---|---|",
        ]
        lines += [
            f"| {r['epoch']} | {r['grad_max_abs_diff']:.2e} | {r['grad_max_abs']:.2e} |"
            for r in digits["history"]
        ]
    else:
        lines += [
            "| epoch | loss reversible | loss standard | test acc. reversible "
            "| test acc. standard | gradient max abs diff | max abs gradient |",
            "|---|---|---|---|---|---|---|",
        ]
    for r in [] if smoke else digits["history"]:
        lines.append(
            f"| {r['epoch']} | {r['loss']['reversible']:.4f} "
            f"| {r['loss']['standard']:.4f} | {r['test_accuracy']['reversible']:.3f} "
            f"| {r['test_accuracy']['standard']:.3f} | {r['grad_max_abs_diff']:.2e} "
            f"| {r['grad_max_abs']:.2e} |"
        )
    temp = digits["temp_bytes"]
    lines += [
        "",
        f"Compiled training step temp memory: {temp['reversible'] / MIB:.3f} MiB "
        f"reversible, {temp['standard'] / MIB:.3f} MiB standard."
        + (
            ""
            if smoke
            else f" Final test accuracy {last['test_accuracy']['reversible']:.3f} "
            f"reversible, {last['test_accuracy']['standard']:.3f} standard."
        ),
        "",
    ]
    if not smoke:
        lines += [f"![digits]({results['figures']['digits']})", ""]
    lines += [
        "`examples/while_loop.py`: a leapfrog integrator trained end to end through",
        f"`revnet.while_loop` ({len(loop['losses'])} adam steps"
        + (
            ", a smoke run: its loss is not a result), and the compiled"
            if smoke
            else f", loss {loop['losses'][0]:.3e} to {loop['losses'][-1]:.3e}), "
            "and the compiled"
        ),
        "temp memory of `jit(grad(loss))` against the number of steps:",
        "",
    ]
    counts = sorted({row["steps"] for row in loop["memory"]})
    lines.append("| method | " + " | ".join(f"{n} steps" for n in counts) + " |")
    lines.append("|---|" + "---|" * len(counts))
    for method in dict.fromkeys(row["method"] for row in loop["memory"]):
        mib = {
            r["steps"]: r["temp_bytes"] / MIB
            for r in loop["memory"]
            if r["method"] == method
        }
        cells = " | ".join(f"{mib[n]:.3f} MiB" for n in counts)
        lines.append(f"| {method} | {cells} |")
    if not smoke:
        lines += ["", f"![while_loop]({results['figures']['while_loop']})"]
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
