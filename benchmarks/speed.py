"""Step time of revnet against the plain Haiku a user would otherwise write.

For each model (the peers' conv stack, the RevNet, the MLP coupling stack and
the transformer) and depth in coupling blocks (the RevNet's units spread over
its three stages), one training gradient step (``jit(grad)``) is timed for
``plain`` (a Python loop of the blocks), ``layer_stack`` and ``reversible`` on
the same parameters (:mod:`benchmarks.models`). Every sample is a fresh process
that compiles, warms up and reports the median of a few steps; the methods'
processes are interleaved in rounds and each figure is the median over rounds.
Ratios are to the *best plain* baseline, the faster of ``plain`` and
``layer_stack``; temp memory and FLOPs come from the same compiled steps.
``--models`` and ``--depths`` measure a part of the sweep (say ``--models mlp
--depths 16``), at the size's rounds and steps.

    python -m benchmarks.speed [--quick | --tiny] [--models a,b] [--depths 4 16]
        [--out results]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks import measure, models

NAME = "speed"
METHODS = ("plain", "layer_stack", "reversible")
MODELS = ("conv", "revnet", "mlp", "transformer")
DEPTHS = {"full": [4, 16, 64], "quick": [4, 16], "tiny": [2]}
ROUNDS = {"full": 5, "quick": 3, "tiny": 1}
STEPS = {"full": 5, "quick": 3, "tiny": 1}
TINY = {
    "mlp": {"width": 32, "batch": 16},
    "conv": {"image_size": 8, "batch": 2, "channels": 8},
    "revnet": {"image_size": 8, "batch": 2},
    "transformer": {"seq_len": 8, "batch": 2},
}


def spec(model: str, method: str, depth: int, size: str) -> dict[str, Any]:
    """One measurement's configuration (see :mod:`benchmarks.models`)."""
    sizes = models.default_sizes(model, quick=True)
    if size == "tiny":
        sizes.update(TINY[model])
    units = max(1, depth // 3) if model == "revnet" else depth
    return {"model": model, "method": method, "depth": units, **sizes}


def main(argv: Sequence[str] | None = None) -> dict:
    """Times every (model, depth), or those asked for; writes ``<out>/speed.json``."""

    def add(parser):
        parser.add_argument(
            "--models",
            type=measure.names_of(MODELS),
            default=None,
            help="a,b of " + ",".join(MODELS),
        )
        parser.add_argument(
            "--depths",
            type=measure.flags.positive_int,
            nargs="+",
            default=None,
            help="in coupling blocks",
        )

    args = measure.parse(__doc__, argv, add)
    size = args.size
    rows = []
    for model in args.models or MODELS:
        for depth in args.depths or DEPTHS[size]:
            payloads = {
                m: {**spec(model, m, depth, size), "time_steps": STEPS[size]}
                for m in METHODS
            }
            got = measure.process_rounds("benchmarks.models", payloads, ROUNDS[size])
            best = models.compare_to_best_plain(got)
            rows.append({"model": model, "depth": depth, "methods": got})
            rows[-1]["best_plain"] = best
    return measure.write_json(args.out, NAME, {"size": size, "rows": rows})


def sizes_note(results: dict) -> str:
    """The sizes of each model in ``results`` (depth and method aside)."""
    size = results.get("size", "full")
    cells = []
    for model in dict.fromkeys(row["model"] for row in results["rows"]):
        shown = spec(model, "plain", 3, size)
        shown = {k: v for k, v in shown.items() if k not in ("method", "depth")}
        del shown["model"]
        cells.append(f"{model} `{shown}`")
    note = "Sizes: " + "; ".join(cells) + "; depth in coupling blocks (RevNet: "
    note += "units spread over its three stages)."
    if ROUNDS.get(size, 2) < 2:
        note += (
            " **Tiny run: one timing per method, so step times and their ratios "
            "are left out (—); only the compiled temp memory is shown.**"
        )
    return note


def markdown(results: dict, out: str) -> str:
    """One table: step time and temp memory, and their ratios to best plain.

    A run with one round (``--tiny``: one process of one step per method) has
    single timings: its times and ratios are left out (—), and the text says so.
    """
    size = results.get("size", "full")
    single = ROUNDS.get(size, 2) < 2
    table = []
    for row in results["rows"]:
        for method, s in row["methods"].items():
            best = method == row.get("best_plain") and not single
            mark = " (best plain)" if best else ""
            cells = [row["model"], row["depth"], method + mark]
            if "error" in s:
                table.append(cells + [f"error: {s['error']}"] + [None] * 4)
                continue
            lo, hi = (s.get(f"time_vs_best_plain_{k}") for k in ("min", "max"))
            spread = None if lo is None else f"{lo:.3g}–{hi:.3g}"
            cells += [1e3 * s["median_s"], s.get("time_vs_best_plain"), spread]
            if single:
                cells[-3:] = [None] * 3
            table.append(
                cells + [s["temp_bytes"] / measure.MIB, s.get("temp_vs_best_plain")]
            )
    head = ["model", "depth", "method", "step ms (median)", "× best plain (median)"]
    head += ["per-round ratio min–max", "temp MiB", "temp / best plain"]
    return "\n\n".join(
        [
            "## Step time against plain Haiku"
            + (": tiny run, single timings left out" if single else ""),
            "One training gradient step per measurement, median over interleaved "
            "fresh processes; ratios to the best plain baseline (the faster of the "
            "unrolled plain-Haiku loop and `hk.layer_stack`): the ratio of the "
            "medians, and the smallest and largest ratio within one round. "
            f"{ROUNDS.get(size, '?')} rounds of {STEPS.get(size, '?')} timed steps.",
            sizes_note(results),
            measure.table(head, table),
        ]
    )


if __name__ == "__main__":
    main()
