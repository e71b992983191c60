"""Runs of many programs: counts per construct, failures shrunk to short
programs, and the report that prints them.
"""

from __future__ import annotations

import collections
import dataclasses
import textwrap
import time
import traceback
from collections.abc import Callable, Iterable

import revnet
from tests.fuzz.check import check_program
from tests.fuzz.compare import Redraw
from tests.fuzz.constructs import CONSTRUCTS, MIN_FEATURED
from tests.fuzz.evaluate import first_line
from tests.fuzz.programs import Program, draw_program

COLUMNS = ("tried", "accepted", "refused", "raised", "wrong")


@dataclasses.dataclass
class Failure:
    """A wrong program: its outcome, message and (shrunk) source."""

    construct: str
    outcome: str
    message: str
    describe: str
    source: str


@dataclasses.dataclass
class Report:
    """Counts per construct (and ``"all"``), failures, redraws and timing."""

    counts: dict = dataclasses.field(
        default_factory=lambda: collections.defaultdict(collections.Counter)
    )
    failures: list = dataclasses.field(default_factory=list)
    redrawn: int = 0
    seconds: float = 0.0
    cpu: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    @property
    def total(self) -> collections.Counter:
        return self.counts["all"]

    def featured(self, name: str) -> int:
        """How many programs were drawn for construct ``name`` (featuring it)."""
        return self.cpu[name + "#n"]

    def add(self, prog: Program, outcome: str):
        """Counts one program in the rows of its constructs and in ``"all"``."""
        for row in [*sorted(prog.constructs), "all"]:
            c = self.counts[row]
            c["tried"] += 1
            c["refused" if outcome == "refused" else "accepted"] += 1
            c["raised"] += outcome == "error"
            c["wrong"] += outcome in ("error", "wrong")

    def merge(self, other: Report):
        for row, c in other.counts.items():
            self.counts[row].update(c)
        self.failures += other.failures
        self.redrawn += other.redrawn
        self.cpu.update(other.cpu)
        self.seconds = max(self.seconds, other.seconds)

    def table(self, timing: bool = False) -> str:
        """The counts table, one row per construct.

        Args:
          timing: add the mean CPU milliseconds of the programs drawn for each
            construct (its ``featured`` programs, redraws included).
        """
        rows = [r for r in CONSTRUCTS if r in self.counts] + ["all"]
        cols = COLUMNS + (("ms",) if timing else ())
        head = f"{'construct':<24}" + "".join(f"{c:>10}" for c in cols)
        lines = [head, "-" * len(head)]
        for r in rows:
            c = self.counts[r]
            line = f"{r:<24}" + "".join(f"{c[k]:>10}" for k in COLUMNS)
            if timing:
                n = self.cpu[r + "#n"]
                line += f"{1000 * self.cpu[r] / n:>10.0f}" if n else f"{'':>10}"
            lines.append(line)
        t = self.total
        lines.append(
            f"{t['tried']} programs in {self.seconds:.1f} s "
            f"({1000 * self.seconds / max(t['tried'], 1):.1f} ms each); "
            f"{self.redrawn} draws redrawn (ill-conditioned or vacuous)"
        )
        return "\n".join(lines)

    def failures_text(self, per_construct: int = 2, source: bool = True) -> str:
        """The first failures of each construct, with message and source."""
        seen: collections.Counter = collections.Counter()
        out = []
        for f in self.failures:
            seen[f.construct] += 1
            if seen[f.construct] > per_construct:
                continue
            out.append(f"[{f.outcome}] {f.construct}: {f.describe}\n  {f.message}")
            if source and f.source:
                out.append(textwrap.indent(f.source, "    "))
        more = len(self.failures) - sum(min(n, per_construct) for n in seen.values())
        if more > 0:
            out.append(f"... and {more} more failures")
        return "\n".join(out)


def _recheck(prog: Program, invertible) -> str:
    try:
        return check_program(prog, invertible)[1]
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {first_line(e)}"


def shrink(prog: Program, outcome: str, invertible=revnet.invertible, budget: int = 12):
    """Removes ops one at a time while the program still fails the same way."""
    ops = list(prog.ops)
    i = 0
    while i < len(ops) and budget > 0 and len(ops) > 1:
        trial = dataclasses.replace(prog, ops=ops[:i] + ops[i + 1 :])
        if trial.expect != prog.expect or (
            prog.featured in CONSTRUCTS
            and CONSTRUCTS[prog.featured].op
            and prog.featured not in trial.constructs
        ):
            i += 1
            continue
        budget -= 1
        try:
            got, _ = check_program(trial, invertible)
        except Exception:  # noqa: BLE001  (ill-conditioned, or a checker crash)
            got = None
        if got == outcome:
            ops = trial.ops
        else:
            i += 1
    return prog if len(ops) == len(prog.ops) else dataclasses.replace(prog, ops=ops)


def run(
    programs: int,
    seed: int = 0,
    only: Iterable[str] | None = None,
    disable: Iterable[str] = (),
    shrink_failures: int = 2,
    invertible=revnet.invertible,
    start: int = 0,
    log: Callable[[str], None] | None = None,
    min_featured: int = MIN_FEATURED,
    feature_weights: dict[str, float] | None = None,
) -> Report:
    """Draws and checks ``programs`` random programs.

    Args:
      programs: how many programs to count (ill-conditioned draws are redrawn).
      seed: the run's seed.
      only: the constructs to enable (all when None).
      disable: constructs to switch off.
      shrink_failures: shrink the first this-many failures of each construct.
      invertible: the decorator under test.
      start: index of the first program (to split a run into chunks).
      log: called with a line for each failure, when given.
      min_featured: draw the first ``min_featured * len(enabled)`` programs for
        each enabled construct in turn (then at random, by
        :data:`~tests.fuzz.constructs.FEATURE_WEIGHTS`).
      feature_weights: overrides of :data:`~tests.fuzz.constructs.FEATURE_WEIGHTS`.

    Returns:
      The report.
    """
    enabled = [n for n in CONSTRUCTS if (only is None or n in set(only))]
    enabled = [n for n in enabled if n not in set(disable)]
    unknown = set(only or ()) | set(disable)
    if unknown - set(CONSTRUCTS):
        raise ValueError(f"unknown constructs: {sorted(unknown - set(CONSTRUCTS))}")
    report = Report()
    t0 = time.perf_counter()
    shrunk: collections.Counter = collections.Counter()
    index = start
    for k in range(programs):
        featured = (
            enabled[k % len(enabled)] if k < min_featured * len(enabled) else None
        )
        t = time.process_time()
        while True:
            prog = draw_program(seed, index, enabled, featured, feature_weights)
            index += 1
            try:
                outcome, message = check_program(prog, invertible)
                break
            except Redraw:
                report.redrawn += 1
            except Exception as e:  # noqa: BLE001  (a crash of the checker itself)
                outcome = "error"
                message = f"checker: {type(e).__name__}: {first_line(e)}"
                message += "\n" + traceback.format_exc(limit=-3)
                break
        report.add(prog, outcome)
        report.cpu[prog.featured] += time.process_time() - t
        report.cpu[prog.featured + "#n"] += 1
        report.cpu["all"] += time.process_time() - t
        report.cpu["all#n"] += 1
        if outcome in ("error", "wrong"):
            small = prog
            if shrunk[prog.featured] < shrink_failures:
                shrunk[prog.featured] += 1
                small = shrink(prog, outcome, invertible)
                if small is not prog:
                    message = _recheck(small, invertible) or message
            failure = Failure(
                prog.featured,
                outcome,
                message,
                small.describe(),
                small.source(scan="revnet.scan"),
            )
            report.failures.append(failure)
            if log:
                log(f"[{outcome}] {small.describe()}\n  {message}")
    report.seconds = time.perf_counter() - t0
    return report
