"""``python -m experiments.NAME``: the entry points to the benchmarks and the
training example.

Each module here is one name; :func:`run_benchmark` is what those that run a
benchmark share: it runs ``benchmarks.<benchmark>``'s ``main`` when the module
is run as a script.
"""

from __future__ import annotations

import importlib


def run_benchmark(module: str, benchmark: str) -> None:
    """Runs :mod:`benchmarks.<benchmark>`'s ``main`` on the command line when
    ``module`` (the caller's ``__name__``) is ``"__main__"``.

    Args:
      module: The calling module's ``__name__``.
      benchmark: The benchmark's module name in :mod:`benchmarks`.
    """
    if module == "__main__":
        importlib.import_module(f"benchmarks.{benchmark}").main()
