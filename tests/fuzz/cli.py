"""The command line: ``python -m tests.fuzz --programs N --seed S --jobs J``."""

import argparse
import multiprocessing
import time

import tests.fuzz
from tests.fuzz import log_dets
from tests.fuzz.constructs import CONSTRUCTS
from tests.fuzz.report import Report, run


def _run_chunk(args):
    programs, seed, only, disable, start = args
    return run(programs, seed, only, disable, start=start)


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m tests.fuzz --programs N --seed S``."""
    p = argparse.ArgumentParser(
        prog="python -m tests.fuzz", description=tests.fuzz.__doc__.split("\n\n")[0]
    )
    p.add_argument("--programs", type=int, default=2000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--jobs", type=int, default=1, help="worker processes")
    p.add_argument("--only", default="", help="comma-separated constructs")
    p.add_argument("--disable", default="", help="comma-separated constructs")
    p.add_argument("--failures", type=int, default=2, help="shown per construct")
    p.add_argument("--verbose", action="store_true", help="print failures as found")
    p.add_argument("--list", action="store_true", help="list the constructs")
    p.add_argument("--timing", action="store_true", help="CPU ms per construct")
    p.add_argument(
        "--log-dets", type=int, default=0, help="random flows checked for log-dets"
    )
    ns = p.parse_args(argv)
    if ns.list:
        for c in CONSTRUCTS.values():
            print(f"{c.name:<24} must {c.expect:<7} families {','.join(c.families)}")
        return 0
    only = [s for s in ns.only.split(",") if s] or None
    disable = [s for s in ns.disable.split(",") if s]
    t0 = time.perf_counter()
    if ns.jobs <= 1:
        log = (lambda s: print(s, flush=True)) if ns.verbose else None
        report = run(ns.programs, ns.seed, only, disable, log=log)
    else:
        per = -(-ns.programs // ns.jobs)
        # Far-apart program indices per chunk: chunks never draw the same program.
        chunks = [
            (min(per, ns.programs - j * per), ns.seed, only, disable, j * 10 * per)
            for j in range(ns.jobs)
            if ns.programs > j * per
        ]
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(len(chunks)) as pool:
            report = Report()
            for part in pool.imap_unordered(_run_chunk, chunks):
                report.merge(part)
    report.seconds = time.perf_counter() - t0
    print(report.table(ns.timing))
    if report.failures:
        print("\nFailures (first of each construct, shrunk):")
        print(report.failures_text(ns.failures))
    wrong = report.total["wrong"]
    if ns.log_dets:
        counts, failures = log_dets.run(ns.log_dets, ns.seed)
        print(f"\n{ns.log_dets} random flows, log-dets against slogdet(jacfwd):")
        print(log_dets.table(counts))
        print("\n".join(failures[: ns.failures * 5]))
        wrong += counts["wrong"]
    return 1 if wrong else 0
