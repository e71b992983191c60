"""Shared measurement helpers for the experiments: the one place that measures.

Every experiment script measures through these functions so that the numbers in
``results/`` come from one method:

* **Memory** of a compiled computation: ``jax.jit(f).lower(*args).compile()``
  and its ``memory_analysis()`` (``temp_size_in_bytes`` is the activation and
  workspace memory XLA plans; deterministic).
* **FLOPs**: ``cost_analysis()['flops']`` of the same executable. XLA counts the
  body of a ``scan``/``while`` loop ONCE, whatever its trip count, so FLOPs of
  scanned stacks are per-step figures; totals need unrolled programs.
* **Peak resident memory** of a real training step: each configuration runs in
  its own subprocess (``python -m experiments.step_worker``), which reports
  ``resource.getrusage(RUSAGE_SELF).ru_maxrss``.
* **Time**: medians over alternating repeated runs after warm-up, with
  ``block_until_ready``. Shared machines are noisy: report ratios with min/max.
* **Output**: JSON with the machine, the versions and the exact configuration,
  written atomically (temporary file + ``os.replace``).

The small command-line helper gives every script the same ``--out``/``--quick``
flags and turns bad flags into a one-line error with a non-zero exit.

Checkpoints live in :mod:`experiments.checkpoint`.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

MIB = 2**20


# --------------------------------------------------------------------------- CLI


def positive_int(text: str) -> int:
    """Argparse type: a strictly positive integer."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    """Argparse type: a strictly positive, finite float."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def even_int(text: str) -> int:
    """Argparse type: a positive even integer (a width split into two halves)."""
    value = positive_int(text)
    if value % 2:
        raise argparse.ArgumentTypeError(
            f"expected an even width (the coupling splits it into two halves), "
            f"got {value}"
        )
    return value


def seed_int(text: str) -> int:
    """Argparse type: a random seed, an integer in ``[0, 2**31 - 1]``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value < 2**31:
        raise argparse.ArgumentTypeError(
            f"expected a seed in [0, 2147483647], got {value}"
        )
    return value


def int_list(text: str) -> list[int]:
    """Argparse type: a comma-separated list of positive integers."""
    values = [positive_int(part) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError("expected a list like 2,4,8")
    return values


def choice_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """Argparse type factory: a comma-separated list drawn from ``choices``."""

    def parse(text: str) -> list[str]:
        names = [part.strip() for part in text.split(",") if part.strip()]
        unknown = [name for name in names if name not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(unknown) or 'empty list'}; "
                f"choose from {', '.join(choices)}"
            )
        return names

    return parse


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are ONE line on stderr, exit status 2.

    Argparse prints the (multi-line) usage before the error; here the error
    line names the flag, the value and what is expected, and ``--help`` has
    the usage.
    """

    def error(self, message: str) -> NoReturn:
        """Prints ``prog: error: message`` and exits with status 2."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def add_choices_flag(
    parser: argparse.ArgumentParser,
    name: str,
    choices: Sequence[str],
    default: Sequence[str],
) -> None:
    """Adds ``--NAME a,b,c``: a comma-separated subset of ``choices``."""
    parser.add_argument(
        f"--{name}",
        type=choice_list(choices),
        default=list(default),
        help=f"comma-separated {name} (default: {','.join(default)})",
    )


def make_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """Returns a parser with the flags every experiment shares.

    Args:
      prog: Program name shown in usage lines (``python -m experiments.NAME``).
      description: One-paragraph description for ``--help``.
    """
    parser = OneLineParser(prog=prog, description=description)
    parser.add_argument(
        "--out", default="results", help="output folder (default: results)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small configuration that runs in about a minute on 2 CPU cores",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="even smaller configuration, for the test suite (implies --quick)",
    )
    return parser


def parse_args(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None = None
) -> argparse.Namespace:
    """Parses ``argv`` and checks that the output folder is writable.

    Errors exit with status 2 and a one-line message (argparse's behaviour),
    never a traceback.
    """
    args = parser.parse_args(argv)
    if getattr(args, "tiny", False):
        args.quick = True
    try:
        os.makedirs(args.out, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=args.out):
            pass
    except OSError as err:
        parser.error(f"output folder {args.out!r} is not writable: {err.strerror}")
    return args


# ----------------------------------------------------------------- output files


def atomic_write_bytes(path: str, data: bytes, previous: str | None = None) -> None:
    """Writes ``data`` to ``path`` atomically (temporary file, then rename).

    The data is written to a temporary file in the same folder and flushed to
    disk (``fsync``) before it replaces ``path``; the folder is synced after
    the rename. A process killed at any point leaves either the old or the
    new file at ``path``, never a partial one.

    Args:
      path: The file to write.
      data: Its new contents.
      previous: If given and ``path`` exists, the old file is first renamed to
        ``previous`` (replacing it), once the new data is safely on disk.
    """
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(
        dir=folder, prefix=".tmp-", suffix=os.path.basename(path)
    )
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        if previous is not None and os.path.exists(path):
            os.replace(path, previous)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_folder(folder)


def _fsync_folder(folder: str) -> None:
    """Makes renames in ``folder`` durable (best effort: not every OS can)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def machine_info() -> dict[str, Any]:
    """The machine and software versions the numbers were measured with."""
    import haiku as hk
    import jax
    import jaxlib

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "haiku": hk.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


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


def write_json(
    out: str, name: str, config: dict[str, Any], results: dict[str, Any]
) -> str:
    """Writes ``<out>/<name>.json`` atomically with machine info and config.

    Returns:
      The path written.
    """
    payload = {
        "experiment": name,
        "command": [os.path.basename(sys.executable), "-m", f"experiments.{name}"]
        + sys.argv[1:],
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_info(),
        "config": config,
        **results,
    }
    path = os.path.join(out, f"{name}.json")
    text = json.dumps(_jsonable(payload), indent=1, allow_nan=False)
    atomic_write_bytes(path, text.encode())
    return path


def save_figure(fig: Any, out: str, name: str) -> str:
    """Saves a matplotlib figure to ``<out>/<name>.png`` atomically."""

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    path = os.path.join(out, f"{name}.png")
    atomic_write_bytes(path, buf.getvalue())
    return path


# ------------------------------------------------------------------- measuring


def log_axes(ax: Any, xlabel: str, ylabel: str, title: str) -> None:
    """Log-log axes (base 2 in x) with labels, a title and a light grid."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)


def compile_stats(fn: Callable[..., Any], *args: Any) -> tuple[Any, dict[str, float]]:
    """Compiles ``jax.jit(fn)`` for ``args`` and reads XLA's plan.

    Returns:
      ``(compiled, stats)``; ``stats`` holds ``temp_bytes`` (activations and
      workspace), ``argument_bytes``, ``output_bytes``, ``total_bytes`` (their
      sum, an upper bound of the device memory the call needs), ``flops`` (loop
      bodies counted once) and ``compile_s``.
    """
    import jax

    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older JAX returned one dict per device
        cost = cost[0]
    stats = {
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
    return compiled, stats


def init_unoptimised(init: Callable[..., Any], *args: Any, static_argnums=()) -> Any:
    """Runs ``jax.jit(init)(*args)`` compiled WITHOUT XLA backend optimisation.

    Initialisers (truncated normals, many small leaves) are run once, yet an
    optimised CPU compile of a RevNet's ``init`` takes ~20 s on a loaded 2-core
    machine; at ``xla_backend_optimization_level=0`` it takes ~3 s. The values
    agree with the optimised compile to float32 rounding. Every method and
    twin is then started from the very same (one) initialisation.
    """
    import jax

    dynamic = [a for i, a in enumerate(args) if i not in static_argnums]
    lowered = jax.jit(init, static_argnums=static_argnums).lower(*args)
    return lowered.compile({"xla_backend_optimization_level": 0})(*dynamic)


def median_times(
    fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 2
) -> dict[str, dict[str, float]]:
    """Times zero-argument callables in alternating rounds.

    Each round calls every function once (in a rotating order, so none always
    runs first) and blocks until its result is ready. Alternating spreads the
    machine's drifting load evenly over the candidates.

    Returns:
      ``{name: {"median_s", "min_s", "max_s", "repeats"}}``.
    """
    import jax

    names = list(fns)
    for _ in range(warmup):
        for name in names:
            jax.block_until_ready(fns[name]())
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            start = time.perf_counter()
            jax.block_until_ready(fns[name]())
            samples[name].append(time.perf_counter() - start)
    return {
        name: {
            "median_s": float(sorted(s)[len(s) // 2])
            if len(s) % 2
            else float(sum(sorted(s)[len(s) // 2 - 1 : len(s) // 2 + 1]) / 2),
            "min_s": float(min(s)),
            "max_s": float(max(s)),
            "repeats": len(s),
        }
        for name, s in samples.items()
    }


def time_ratios(
    times: dict[str, dict[str, float]], baseline: str
) -> dict[str, dict[str, float]]:
    """Median, min and max step time of each entry relative to ``baseline``.

    ``min_ratio``/``max_ratio`` pair the fastest (slowest) run of an entry with
    the fastest (slowest) run of the baseline, to show the spread.
    """
    base = times[baseline]
    return {
        name: {
            "median_ratio": t["median_s"] / base["median_s"],
            "min_ratio": t["min_s"] / base["min_s"],
            "max_ratio": t["max_s"] / base["max_s"],
        }
        for name, t in times.items()
    }


def peak_rss_subprocess(
    spec: dict[str, Any], timeout_s: float = 300.0, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Runs one training step of ``spec`` in a fresh process; returns its RSS.

    The worker (``experiments.step_worker``) builds the configuration, compiles
    and runs a few training steps, and prints one JSON line with
    ``peak_rss_mib`` (``ru_maxrss`` at exit), ``rss_before_step_mib`` (after
    compiling and allocating the inputs) and ``step_rss_increase_mib``.

    Returns:
      The worker's JSON, or ``{"error": message}`` if it failed.
    """
    cmd = [sys.executable, "-m", "experiments.step_worker", json.dumps(spec)]
    try:
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={**os.environ, **(env or {})},
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {proc.returncode}: {tail}"}
    return json.loads(lines[-1])


def largest_fitting(
    measure: Callable[[int], float], budget: float, guess: int, cap: int
) -> tuple[int | None, int]:
    """Largest ``n`` in ``[1, cap]`` with ``measure(n) <= budget``.

    Assumes ``measure`` increases with ``n`` and is close to affine (memory in
    depth or batch). Each step interpolates through the two nearest measured
    points inside the current bracket (the secant method), falling back to
    bisection, so an affine ``measure`` costs about three calls.

    Returns:
      ``(n, calls)``; ``n`` is None if not even 1 fits, and ``cap`` when ``cap``
      fits (the answer is then "at least cap").
    """
    seen: dict[int, float] = {}

    def value(n: int) -> float:
        if n not in seen:
            seen[n] = measure(n)
        return seen[n]

    lo, hi = 0, cap + 1  # invariant: lo fits (0: trivially), hi does not
    n = min(max(1, guess), cap)
    while True:
        if value(n) <= budget:
            lo = n
        else:
            hi = n
        if hi - lo <= 1:
            break
        ends = (min(seen), max(seen))
        slope = (seen[ends[1]] - seen[ends[0]]) / (ends[1] - ends[0] or 1)
        anchor = lo if lo else ends[0]
        if slope > 0 and len(seen) <= 6:  # affine estimate, then bisection
            n = anchor + int((budget - seen[anchor]) // slope)
        elif hi > cap:
            n = min(cap, 2 * lo)
        else:
            n = (lo + hi) // 2
        n = min(max(n, lo + 1), hi - 1)
    if lo == 0:
        return None, len(seen)
    return lo, len(seen)
