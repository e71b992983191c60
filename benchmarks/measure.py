"""The one place that measures: every benchmark's numbers come from here.

* **Memory** of a compiled program: ``jax.jit(f).lower(*args).compile()`` and
  its ``memory_analysis()`` (``temp_size_in_bytes``, the activation and
  workspace memory XLA plans; deterministic).
* **FLOPs**: ``cost_analysis()['flops']`` of the same executable. XLA counts a
  ``scan``/``while`` body ONCE, whatever its trip count.
* **Time**: medians over interleaved rounds (each round calls every candidate
  once, in a rotating order) after warm-up, with ``block_until_ready``; in one
  process (:func:`median_times`) or one fresh process per sample
  (:func:`process_rounds`). Shared machines are noisy: report medians and
  their ratios, with the spread as the min and max of per-round ratios
  (:func:`ratio_spread`; a ratio of two minima is neither).
* **Peak resident memory** in a fresh process (:func:`run_worker`, and
  :func:`rss_mib` / :func:`reset_peak_rss` inside it).
* **Output**: JSON with the machine and versions, written atomically.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

MIB = 2**20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_example_module(name: str):
    """``examples/<name>.py``, a helper the examples use too (the examples are
    scripts, not a package: loaded from its file)."""
    path = os.path.join(ROOT, "examples", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"revnet_examples{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


flags = load_example_module("_flags")  # the flag types
# Writes a file whole or not at all (a synced temporary file and a rename).
atomic_write = load_example_module("_durable").write_atomically


def parse(doc: str, argv: Sequence[str] | None, add=None) -> argparse.Namespace:
    """Parses ``--out DIR``, ``--quick``, ``--tiny`` (implies quick) and ``add``'s;
    ``args.size`` names the size: ``"tiny"``, ``"quick"`` or ``"full"``.

    A bad flag, or an output folder that cannot be written, ends the program
    at once with one line and exit status 2 (``examples/_flags.py``).
    """
    parser = flags.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument(
        "--out", type=flags.writable_dir, default="results", help="output folder"
    )
    parser.add_argument("--quick", action="store_true", help="a smaller run")
    parser.add_argument("--tiny", action="store_true", help="smallest (tests)")
    if add is not None:
        add(parser)
    args = parser.parse_args(argv)
    args.quick = args.quick or args.tiny
    args.size = "tiny" if args.tiny else "quick" if args.quick else "full"
    return args


def names_of(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse ``type``: a comma-separated list of names from ``choices``;
    an unknown or empty one ends the program in one line."""

    def parse_names(text: str) -> list[str]:
        names = [n for n in text.split(",") if n]
        unknown = sorted(set(names) - set(choices))
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {unknown or text!r}")
        return names

    return parse_names


def compile_stats(fn: Callable[..., Any], *args: Any) -> tuple[Any, dict[str, float]]:
    """``(compiled, stats)`` of ``jax.jit(fn)`` for ``args``: bytes, FLOPs, time."""
    import jax

    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    seconds = time.perf_counter() - start
    mem, cost = compiled.memory_analysis(), compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older JAX: one dict per device
        cost = cost[0]
    return compiled, {
        "temp_bytes": float(mem.temp_size_in_bytes),
        "argument_bytes": float(mem.argument_size_in_bytes),
        "output_bytes": float(mem.output_size_in_bytes),
        "total_bytes": float(
            mem.temp_size_in_bytes
            + mem.argument_size_in_bytes
            + mem.output_size_in_bytes
            - mem.alias_size_in_bytes
        ),
        "flops": float(cost.get("flops", float("nan"))),
        "compile_s": seconds,
    }


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """``{"median_s", "min_s", "max_s", "repeats"}`` of timing samples."""
    return {
        "median_s": float(statistics.median(samples)),
        "min_s": float(min(samples)),
        "max_s": float(max(samples)),
        "repeats": len(samples),
    }


def rounds(names: Sequence[str], repeats: int):
    """``(round, name)`` pairs: every name once a round, in a rotating order."""
    for r in range(repeats):
        for name in list(names[r % len(names) :]) + list(names[: r % len(names)]):
            yield r, name


def median_times(
    fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 2
) -> dict[str, dict[str, float]]:
    """Times zero-argument callables in interleaved rounds, in this process."""
    import jax

    for _ in range(warmup):
        for fn in fns.values():
            jax.block_until_ready(fn())
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _, name in rounds(list(fns), repeats):
        start = time.perf_counter()
        jax.block_until_ready(fns[name]())
        samples[name].append(time.perf_counter() - start)
    return {name: {**summarize(s), "samples_s": s} for name, s in samples.items()}


def ratio_spread(
    samples: Sequence[float | None], base: Sequence[float | None]
) -> dict[str, float] | None:
    """``{"min", "max"}`` of the per-round ratios ``samples[r] / base[r]``.

    Both lists hold one sample per round, in round order (as
    :func:`median_times` and :func:`process_rounds` interleave them; None for
    a failed round). The ratio of the two medians lies between these two,
    unlike the ratio of two minima and of two maxima. None if no round has
    both samples.
    """
    if len(samples) != len(base):
        return None
    ratios = [a / b for a, b in zip(samples, base) if a is not None and b]
    return {"min": min(ratios), "max": max(ratios)} if ratios else None


def run_worker(
    module: str, payload: Any, env: dict[str, str] | None = None, timeout: float = 1800
) -> dict[str, Any]:
    """Runs ``python -m module '<payload json>'`` in a fresh process.

    Returns:
      The last JSON line it printed, or ``{"error": message}``.
    """
    cmd = [sys.executable, "-m", module, json.dumps(payload)]
    env = {**os.environ, "REVNET_RUNTIME_CHECKS": "0", **(env or {})}
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {proc.returncode}: {tail}"}
    return json.loads(lines[-1])


def process_rounds(
    module: str, payloads: dict[str, Any], repeats: int
) -> dict[str, dict[str, Any]]:
    """Interleaved rounds of fresh workers that each report a ``median_s``.

    Compiled programs are shared between rounds through a persistent cache, so
    only timing is repeated. Each entry summarizes the processes' medians and
    keeps the first worker's other figures (``samples_s``: each round's median,
    None where that round failed), or holds the last ``error``.
    """
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in payloads}
    with tempfile.TemporaryDirectory(prefix="revnet-bench-") as cache:
        env = {
            "JAX_COMPILATION_CACHE_DIR": cache,
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
        }
        for r, name in rounds(list(payloads), repeats):
            res = run_worker(module, payloads[name], env)
            runs[name].append(res)
            shown = res.get("error") or f"{1e3 * res['median_s']:.2f} ms"
            print(f"[{module}] round {r} {name}: {shown}", flush=True)
    out = {}
    for name, results in runs.items():
        good = [res for res in results if "error" not in res]
        if not good:
            out[name] = {"error": results[-1]["error"]}
            continue
        medians = [res["median_s"] for res in good]
        out[name] = {**good[0], **summarize(medians), "process_medians_s": medians}
        out[name]["samples_s"] = [res.get("median_s") for res in results]
    return out


def rss_mib(field: str | None = None) -> float | None:
    """``ru_maxrss`` of this process in MiB, or a ``/proc/self/status`` field."""
    if field is None:
        scale = 1 if sys.platform == "darwin" else 1024  # Linux: KiB
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / MIB
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Resets the peak RSS (``VmHWM``) to the current RSS; True on success."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return _jsonable(value.item())
    return value


def write_json(out: str, name: str, results: dict[str, Any]) -> dict[str, Any]:
    """Adds the machine to ``results`` and writes ``<out>/<name>.json``."""
    import haiku as hk
    import jax

    results["machine"] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "haiku": hk.__version__,
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    text = json.dumps(_jsonable(results), indent=1, allow_nan=False)
    atomic_write(os.path.join(out, f"{name}.json"), text.encode())
    return results


def save_figure(fig: Any, out: str, name: str) -> str:
    """Saves a matplotlib figure as ``<out>/<name>.png``; returns the file name."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    atomic_write(os.path.join(out, f"{name}.png"), buf.getvalue())
    return f"{name}.png"


def log_axes(ax: Any, xlabel: str, ylabel: str, title: str) -> None:
    """Log-log axes (base 2 in x) with labels, a title and a light grid."""
    ax.set(yscale="log", xlabel=xlabel, ylabel=ylabel, title=title)
    ax.set_xscale("log", base=2)
    ax.grid(True, which="both", alpha=0.3)


def coinciding(
    series: Sequence[dict[str, Any]], log_y: bool, tol: float = 0.02
) -> list[str | None]:
    """For each series, the label of an earlier one it would hide, or None.

    Two series coincide when the x values of one are among the other's and
    their y values differ by less than ``tol`` of the plotted y span (in log10
    on a log axis) at every shared x: drawn one over the other, the later one
    hides (that part of) the other.
    """

    def f(v: float) -> float | None:
        if v is None or not math.isfinite(v) or (log_y and v <= 0):
            return None
        return math.log10(v) if log_y else v

    points = [dict(zip(s["x"], (f(v) for v in s["y"]))) for s in series]
    seen = [v for p in points for v in p.values() if v is not None]
    span = (max(seen) - min(seen)) if seen else 0.0
    span = span or (abs(seen[0]) if seen else 0.0) or 1.0
    out: list[str | None] = []
    for i, mine in enumerate(points):
        hit = None
        for j, other in enumerate(points[:i]):
            shared = mine.keys() & other.keys()
            nested = shared and shared in (mine.keys(), other.keys())
            if nested and all(
                mine[x] is not None
                and other[x] is not None
                and abs(mine[x] - other[x]) <= tol * span
                for x in shared
            ):
                hit = series[j]["label"]
                break
        out.append(hit)
    return out


def plot_lines(ax: Any, series: Sequence[dict[str, Any]], log_y: bool) -> None:
    """Draws ``series`` on ``ax`` so that no series hides another.

    Each series is a dict with ``label``, ``x``, ``y`` and optionally
    ``yerr`` (``[below, above]``), ``color``, ``marker`` and ``ls`` (default
    ``"-"``). One that would lie on an earlier one (:func:`coinciding`) is
    drawn on top, dashed, with larger hollow markers, and its legend label
    says ``(overlaps <the other>)``.
    """
    stacked: dict[str, int] = {}  # series drawn so far over each one
    for s, under in zip(series, coinciding(series, log_y)):
        kw = {"color": s.get("color"), "marker": s.get("marker", "o")}
        kw["ls"], kw["label"] = s.get("ls", "-"), s["label"]
        if under is not None:
            n = stacked[under] = stacked.get(under, 0) + 1
            kw.update(mfc="none", ms=6 + 4 * n, mew=1.5, zorder=2 + n)
            kw["label"] = f"{s['label']} (overlaps {under})"
            if kw["ls"] == "-":
                kw["ls"] = ("--", ":", "-.")[(n - 1) % 3]
        if s.get("yerr") is not None:
            ax.errorbar(s["x"], s["y"], yerr=s["yerr"], capsize=3, **kw)
        else:
            ax.plot(s["x"], s["y"], **kw)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table; floats with three significant digits."""

    def fmt(v: Any) -> str:
        if v is None:
            return "—"
        if isinstance(v, float) and math.isfinite(v) and v != 0:
            return f"{v:.2e}" if abs(v) < 1e-3 or abs(v) >= 1e5 else f"{v:.3g}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(map(fmt, r)) + " |" for r in rows])
