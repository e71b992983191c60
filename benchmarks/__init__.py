"""Benchmarks: each module has ``NAME``, ``main(argv)`` and ``markdown(results, out)``.

``main`` parses ``--out DIR`` (default ``results``), ``--quick`` and ``--tiny``,
writes ``DIR/<NAME>.json`` (and its plots, as PNGs) and returns the results;
``markdown`` renders that JSON as the benchmark's section of ``REPORT.md``.
:data:`BENCHMARKS` lists them in report order; ``python -m benchmarks.run``
runs them (``make demo-full``). Adding a benchmark is one module and one entry
here. ``benchmarks.demo`` (``make demo``) is not in the list: it runs a small
set of these measurements, with their code, into a report of its own.
"""

# Report name -> module under ``benchmarks``.
BENCHMARKS = {
    "budget": "budget",
    "memory": "memory",
    "speed": "speed",
    "train": "training",
    "numerics": "numerics",
    "exact": "exact",
    "loops": "loops",
    "overhead": "overhead",
    "decisions": "decisions",
    "sharding": "sharding",
    "front_doors": "front_doors",
    "flows": "flows",
    "simulation": "simulation",
}
