"""Writes ``REPORT.md`` from the experiments' JSON files, plots embedded.

Every number in the report is read from ``<out>/<name>.json``; nothing is
typed in by hand. Run ``python -m experiments.report --out results`` to
rebuild the report from existing results.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from experiments import common

MIB = 2**20


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.{digits - 1}e}"
        return f"{value:.{digits}g}"
    return str(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _load(out: str, name: str) -> dict[str, Any] | None:
    path = os.path.join(out, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _image(out: str, name: str) -> str:
    return (
        f"![{name}]({name}.png)"
        if os.path.exists(os.path.join(out, f"{name}.png"))
        else ""
    )


def memory_section(res: dict[str, Any], out: str) -> str:
    """Tables for the memory sweep."""
    parts = ["## Memory, FLOPs and time vs depth (`experiments.memory`)", ""]
    parts.append(
        "Same parameters trained every way a user could: `plain` (the block "
        "functions in a Python loop, plain Haiku and ordinary backprop), "
        "`layer_stack` (`hk.layer_stack`), standard backprop on the "
        "`reversible=False` twin (a scan), per-block checkpointing (every coupling "
        "wrapped in `hk.remat` on the twin), and the reversible backward pass; for "
        "the MLP also the same stack as a plain function under "
        "`@revnet.invertible` (`generic`). *Best plain* is the faster of `plain` "
        "and `layer_stack` at each depth: the baseline users actually have. "
        "Memory is the compiled `temp_size_in_bytes`; FLOPs come from "
        "`cost_analysis()`, which counts a scan body ONCE whatever the depth, so "
        "these FLOP ratios are per-block ratios of the scanned stacks (plus fixed "
        "parts such as the stem and head); the unrolled MLP rows below give the "
        "true per-block cost. Step time: median over alternating runs, ratio to "
        "standard with the ratio of the fastest (slowest) runs as min (max)."
    )
    parts.append("")
    parts.append(_image(out, "memory"))
    for name, model in res["models"].items():
        rows = model.get("rows") or []
        parts += ["", f"### {name}", ""]
        if model.get("missing"):
            parts.append(f"Missing: {model['missing']}")
        if not rows:
            continue
        parts.append(f"Sizes: `{json.dumps(model['sizes'])}`")
        parts.append("")
        parts.append(
            _table(
                [
                    "depth",
                    "method",
                    "temp MiB",
                    "temp / std",
                    "FLOPs / std",
                    "time / std (median)",
                    "min",
                    "max",
                    "time / best plain",
                    "temp / best plain",
                ],
                [
                    [
                        r["depth"],
                        r["method"],
                        r["temp_bytes"] / MIB,
                        r.get("temp_ratio"),
                        r.get("flops_ratio"),
                        r.get("time_ratio"),
                        r.get("time_ratio_min"),
                        r.get("time_ratio_max"),
                        r.get("time_vs_best_plain"),
                        r.get("temp_vs_best_plain"),
                    ]
                    for r in rows
                ],
            )
        )
        unrolled = model.get("unrolled_flops")
        if unrolled and unrolled.get("per_block_ratio"):
            parts += [
                "",
                "Unrolled (no scan) per-block FLOPs, from depths "
                f"{unrolled['depths']}:",
                "",
            ]
            parts.append(
                _table(
                    ["method", "FLOPs per block", "ratio to standard"],
                    [
                        [m, f, unrolled["per_block_ratio"][m]]
                        for m, f in unrolled["per_block_flops"].items()
                    ],
                )
            )
        budget = model.get("budget")
        if budget:
            parts += [
                "",
                f"Largest configuration fitting {budget['budget_mib']:g} MiB "
                "(arguments + outputs + temporaries of the compiled step; "
                "searched by compiling):",
                "",
            ]
            brows = []
            for m, b in budget["methods"].items():
                depth = b["largest_depth"]
                batch = b.get("largest_batch_at_depth") or {}
                at = f" (depth {_fmt(batch['depth'])})" if batch else ""
                brows.append(
                    [
                        m,
                        f"{'≥' if depth['at_cap'] else ''}{_fmt(depth['largest'])}",
                        f"{_fmt(batch.get('largest'))}{at}",
                    ]
                )
            parts.append(_table(["method", "largest depth", "largest batch"], brows))
        rss = [r for r in model.get("rss") or [] if "peak_rss_mib" in r]
        if rss:
            parts += [
                "",
                "Resident memory of real training steps, one process each. The "
                "process peak is set by imports and XLA compilation (the same "
                "for every method); the step columns reset the high-water mark "
                "just before the steps (`/proc/self/clear_refs`) and show what "
                "the steps themselves add over the resident memory before them "
                "(compare with the compiled temp memory above).",
                "",
            ]
            parts.append(
                _table(
                    [
                        "depth",
                        "method",
                        "process peak MiB",
                        "RSS before steps MiB",
                        "step peak MiB",
                        "step increase MiB",
                        "peak reset worked",
                    ],
                    [
                        [
                            r["depth"],
                            r["method"],
                            r["peak_rss_mib"],
                            r.get("rss_before_step_mib"),
                            r.get("step_peak_rss_mib"),
                            r["step_rss_increase_mib"],
                            r.get("step_hwm_reset"),
                        ]
                        for r in rss
                    ],
                )
            )
        errors = [r for r in model.get("rss") or [] if "error" in r]
        if errors:
            parts.append(f"RSS errors: {errors}")
    summary = res.get("summary", {})
    lines = []
    for name, s in summary.items():
        if "standard_over_reversible_temp" in s:
            lines.append(
                f"- **{name}** at depth {s['largest_depth']}: standard uses "
                f"{_fmt(s['standard_over_reversible_temp'])}× the reversible "
                f"activation memory; reversible memory varies by a factor "
                f"{_fmt(s.get('reversible_temp_spread'))} over the sweep; FLOPs "
                f"{_fmt(s['reversible']['flops_ratio'])}× standard; step time "
                f"{_fmt(s['reversible']['time_ratio'])}× "
                f"(min {_fmt(s['reversible']['time_ratio_min'])}, max "
                f"{_fmt(s['reversible']['time_ratio_max'])})."
            )
        if "generic_over_sequence" in s:
            g = s["generic_over_sequence"]
            lines.append(
                f"- **generic `@revnet.invertible` vs `ReversibleSequence`** "
                f"({name}): memory {_fmt(g['temp'])}×, FLOPs {_fmt(g['flops'])}× "
                "(goal: within 5%)."
            )
    if lines:
        parts += ["", "### Summary", ""] + lines
    return "\n".join(parts)


def train_section(res: dict[str, Any], out: str) -> str:
    """Tables for the digits training."""
    st = res.get("step_time", {})
    ratio = st.get("ratio_reversible_over_standard") or {}
    cfg = res["config"]
    parts = [
        "## Training a RevNet on digits (`experiments.train`)",
        "",
        f"RevNet with units {cfg.get('units')} and channels {cfg.get('channels')}, "
        f"{res['train_size']} training / {res['test_size']} test images (8×8, "
        f"scikit-learn digits), batch {cfg.get('batch')} over {res['num_devices']} "
        f"device(s), {res['epochs_done']} epochs of SGD with momentum. Both twins "
        "start from the same parameters and see the same batches.",
        "",
        _image(out, "train"),
        "",
        _table(
            [
                "twin",
                "test accuracy",
                "final loss",
                "median step s",
                "compiled step temp MiB",
            ],
            [
                [
                    t,
                    res["test_accuracy"].get(t),
                    res["final_loss"].get(t),
                    st.get(t, {}).get("median_s"),
                    res["compiled_step_memory"][t]["temp_bytes"] / MIB,
                ]
                for t in ("reversible", "standard")
            ],
        ),
        "",
        *_twin_comparison(res),
        f"- Step time reversible / standard (paired steps): median "
        f"{_fmt(ratio.get('median'))}, min {_fmt(ratio.get('min'))}, max "
        f"{_fmt(ratio.get('max'))}.",
        f"- Process peak RSS (both twins in one process): "
        f"{_fmt(res['process_peak_rss_mib'])} MiB.",
    ]
    return "\n".join(parts)


def _twin_comparison(res: dict[str, Any]) -> list[str]:
    """The lock-step, free-running and control comparisons, as bullet points."""
    n = len(res["history"]["step"])
    lock = res.get("lockstep") or {}
    control = res.get("control") or {}
    lines = [
        f"- **Lock-step** (at each of the {n} logged steps, the standard twin's "
        "loss and gradients evaluated on the reversible twin's current "
        "parameters and BatchNorm state, on the same batch): largest |loss "
        f"difference| {_fmt(lock.get('loss_max_abs_diff'))} (requirement: "
        "< 1e-3); largest gradient difference "
        f"{_fmt(lock.get('grad_rel_diff_max'))} relative (global norm; median "
        f"over steps {_fmt(lock.get('grad_rel_diff_median'))}), "
        f"{_fmt(lock.get('grad_max_diff_max'))} in max-abs relative to the "
        "largest gradient entry. This is the direct statement that the "
        "reversible backward pass computes backprop's gradients.",
        f"- **Free-running** (each twin on its own trajectory): largest |loss "
        f"difference| {_fmt(res.get('loss_max_abs_diff'))}, "
        f"{_fmt(res.get('free_running_first_epoch_max_abs_diff'))} during the "
        "first (warm-up) epoch; first step above 1e-3: "
        f"{_fmt(res.get('first_step_over_1e-3'))}.",
    ]
    if control:
        lines.append(
            "- **Control** (the standard twin against itself, started from "
            f"parameters multiplied by 1 + {_fmt(control.get('relative_perturbation'))}"
            " × N(0, 1), i.e. about one float32 ulp): largest |loss difference| "
            f"{_fmt(control.get('loss_max_abs_diff'))}, "
            f"{_fmt(control.get('first_epoch_max_abs_diff'))} during the first "
            f"epoch; first step above 1e-3: {_fmt(control.get('first_step_over_1e-3'))}"
            f"; test accuracy {_fmt(control.get('test_accuracy'))}. The free-running "
            "twins drift apart as much as this control does: the training "
            "dynamics amplify float32 rounding noise (the twins' gradients differ "
            "by rounding only, see lock-step), so a free-running comparison "
            "cannot resolve differences below this level."
        )
    return lines


def numerics_section(res: dict[str, Any], out: str) -> str:
    """Tables for the numerics sweep."""
    threshold = res["config"]["threshold"]
    parts = [
        "## Numerics: reconstruction and gradient error (`experiments.numerics`)",
        "",
        "Relative L2 errors. Gradients are compared with ordinary backprop in "
        "float64 (so the float64 `standard` column is 0 by construction). "
        f'"Invertible" means reconstruction error < {threshold:g} at that depth '
        "and every smaller measured depth.",
        "",
        _image(out, "numerics"),
        "",
        _table(
            [
                "coupling",
                "depth",
                "dtype",
                "reconstruction",
                "grad rev",
                "grad std",
                "memory rev / std",
            ],
            [
                [
                    r["coupling"],
                    r["depth"],
                    r["dtype"],
                    r["reconstruction_rel_error"],
                    r["grad_rel_error_reversible"],
                    r["grad_rel_error_standard"],
                    r.get("temp_vs_standard"),
                ]
                for r in res["rows"]
            ],
        ),
        "",
        "With anchors (`anchor_every=k`): the reversible gradient error, the "
        "backward pass's activation memory relative to standard backprop's "
        "(compiled `temp_size_in_bytes`, float32), and the drift monitor's "
        "largest reading next to the largest reconstruction error at an anchor "
        "measured independently (each segment inverted on its own).",
        "",
        _table(
            [
                "coupling",
                "depth",
                "dtype",
                "k",
                "grad rev",
                "grad std",
                "memory / std",
                "drift read",
                "drift true",
            ],
            [
                [
                    r["coupling"],
                    r["depth"],
                    r["dtype"],
                    int(k),
                    a["grad_rel_error"],
                    r["grad_rel_error_standard"],
                    a["temp_vs_standard"],
                    a["drift_max"],
                    a["true_drift_max"],
                ]
                for r in res["rows"]
                for k, a in r.get("anchored", {}).items()
            ],
        ),
        "",
        _table(
            ["coupling", "dtype", "largest invertible depth measured"],
            [
                [c, d, v["largest_invertible_depth"]]
                for c, by in res["limits"].items()
                for d, v in by.items()
            ],
        ),
    ]
    return "\n".join(parts)


_LOOP_METHODS = {
    "revnet": "revnet (auto)",
    "revnet checkpoint": "revnet, `invert=False`",
    "checkpointed lax.scan": "`jax.checkpoint` + `lax.scan`",
    "unrolled": "unrolled backprop",
}


def loops_section(res: dict[str, Any], out: str) -> str:
    """The loops experiment: its three-body comparison as one compact table."""
    rows = res["comparison"]
    steps = sorted({r["steps"] for r in rows if r["sweep"] == "steps"})
    sweep = [r for r in rows if r["sweep"] == "max_steps"]
    maxes = sorted({r["max_steps"] for r in sweep})
    (fixed,) = {r["steps"] for r in sweep}
    by_key = {
        (r["body"], r["method"], r["sweep"], r["steps"], r["max_steps"]): r
        for r in rows
    }

    def cell(body, method, key, points, scale=None):
        values = []
        for sweep_name, n, m in points:
            r = by_key.get((body, method, sweep_name, n, m))
            value = None if r is None else r[key] if scale is None else r[key] / scale
            if value is not None and key == "body_evaluations":
                value = int(value)
            values.append(_fmt(value))
        return " / ".join(values)

    at_steps = [("steps", n, n) for n in steps]
    at_maxes = [("max_steps", fixed, m) for m in (maxes[0], maxes[-1])]
    last = ("steps", steps[-1], steps[-1])
    table_rows = []
    for body in dict.fromkeys(r["body"] for r in rows):
        base = by_key.get((body, "checkpointed lax.scan", *last))
        for method, label in _LOOP_METHODS.items():
            r = by_key.get((body, method, *last))
            ratio = (
                None if r is None or base is None else r["median_s"] / base["median_s"]
            )
            table_rows.append(
                [
                    body,
                    label,
                    cell(body, method, "temp_bytes", at_steps, MIB),
                    cell(body, method, "temp_bytes", at_maxes, MIB),
                    cell(body, method, "body_evaluations", at_steps),
                    cell(body, method, "body_evaluations", at_maxes),
                    ratio,
                ]
            )
    n_text = " / ".join(map(str, steps))
    m_text = f"n = {fixed}, max_steps {maxes[0]} / {maxes[-1]}"
    table = _table(
        [
            "body",
            "method",
            f"temp MiB, n = {n_text}",
            f"temp MiB, {m_text}",
            f"body evaluations, n = {n_text}",
            f"body evaluations, {m_text}",
            f"time / checkpointed scan's, n = {steps[-1]}",
        ],
        table_rows,
    )
    rest = generic_section(
        "loops", {k: v for k, v in res.items() if k != "comparison"}, out
    )
    head, _, body_text = rest.partition("\n\n")
    intro = (
        "Three bodies (invertible leapfrog, leapfrog with a running maximum, a "
        "damped map) four ways: compiled temp memory of `jit(grad)`, body "
        "evaluations per gradient (forward, recomputed and inverted, counted "
        "by a host callback) and median step time, against steps taken `n` "
        "(`max_steps = n`) and against `max_steps`."
    )
    return "\n\n".join([head, intro, table, body_text])


def generic_section(name: str, res: dict[str, Any], out: str) -> str:
    """A section for an experiment this module does not know in detail."""
    parts = [f"## {name} (`experiments.{name}`)", "", _image(out, name), ""]
    for key, value in res.items():
        if key in ("experiment", "command", "time_utc", "machine"):
            continue
        if isinstance(value, list) and value and isinstance(value[0], dict):
            header = list(dict.fromkeys(k for row in value for k in row))
            header = [
                k for k in header if not isinstance(value[0].get(k), (list, dict))
            ]
            parts += [
                f"**{key}**",
                "",
                _table(header, [[r.get(k) for k in header] for r in value]),
                "",
            ]
        elif isinstance(value, dict):
            flat = {k: v for k, v in value.items() if not isinstance(v, (list, dict))}
            if flat:
                parts += [
                    f"**{key}**",
                    "",
                    _table(["field", "value"], list(flat.items())),
                    "",
                ]
    return "\n".join(parts)


def markdown_section(name: str, out: str) -> str | None:
    """The experiment's own ``<name>.md`` table, if it wrote one."""
    path = os.path.join(out, f"{name}.md")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        lines = f.read().strip().splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    return f"## {name} (`experiments.{name}`)\n" + "\n".join(lines)


def write_report(out: str, runs: Sequence[dict[str, Any]] = ()) -> str:
    """Writes ``<out>/REPORT.md`` from whatever JSON files exist there.

    Args:
      out: The results folder.
      runs: Optional records ``{"name", "returncode", "seconds"}`` of the runs
        that produced the folder (from ``experiments.demo``).

    Returns:
      The path of the report.
    """
    known = {
        "memory": memory_section,
        "train": train_section,
        "numerics": numerics_section,
        "loops": loops_section,
    }
    sections = []
    machine = None
    for name in ("memory", "speed", "train", "numerics", "loops", "overhead"):
        res = _load(out, name)
        own = markdown_section(name, out) if name not in known else None
        if res is not None and own is not None:
            machine = machine or res.get("machine")
            sections.append(own)
            continue
        if res is None:
            sections.append(f"## {name}\n\nNo `{name}.json` in this folder.")
            continue
        machine = machine or res.get("machine")
        builder = known.get(name)
        try:
            sections.append(
                builder(res, out) if builder else generic_section(name, res, out)
            )
        except (KeyError, TypeError, ValueError) as err:
            sections.append(f"## {name}\n\nCould not render `{name}.json`: {err!r}")
    head = ["# revnet: experiment report", ""]
    if machine:
        head.append(
            f"Machine: {machine.get('platform')}, {machine.get('cpu_count')} CPUs, "
            f"backend {machine.get('backend')}; jax {machine.get('jax')}, haiku "
            f"{machine.get('haiku')}, Python {machine.get('python')}. Figures are "
            "from one run; times on shared machines move by ±50%, compiled memory "
            "and FLOPs are deterministic."
        )
    if runs:
        head += [
            "",
            _table(
                ["script", "exit code", "seconds"],
                [[r["name"], r["returncode"], r["seconds"]] for r in runs],
            ),
        ]
    text = "\n\n".join(["\n".join(head), *sections]) + "\n"
    path = os.path.join(out, "REPORT.md")
    common.atomic_write_bytes(path, text.encode())
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """Rebuilds the report of an existing results folder."""
    parser = common.make_parser(
        "python -m experiments.report", __doc__.split("\n\n")[0]
    )
    args = common.parse_args(parser, argv)
    print(write_report(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
