"""Every ``python -m experiments.<name> --quick`` runs to the end.

The quick runs are what ``make demo`` and a reader of the docs run; together
they take tens of minutes on 2 cores, so they are their own tier (marked
``experiments``: ``make test-experiments``), outside ``make test-all``. The
slow tier's ``--tiny`` runs (tests/project/test_benchmarks.py) go through the
same code paths at the smallest sizes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.experiments]

# Each benchmark entry, by its JSON file; the report last (it reads them).
ENTRIES = {
    "memory": "memory.json",
    "speed": "speed.json",
    "numerics": "numerics.json",
    "loops": "loops.json",
    "loop_compare": "loops.json",  # the same benchmark as loops
    "overhead": "overhead.json",
    "demo": None,
    "train": None,
}


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("experiments")


def _run(name: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", f"experiments.{name}", *argv],
        cwd=ROOT,
        env=subprocess_env(None),
        capture_output=True,
        text=True,
        timeout=1800,
    )


def test_every_experiment_module_is_listed():
    names = {
        f[:-3]
        for f in os.listdir(os.path.join(ROOT, "experiments"))
        if f.endswith(".py") and f != "__init__.py"
    }
    assert names == {*ENTRIES, "report"}, names


@pytest.mark.parametrize("name", list(ENTRIES))
def test_quick_run(name, out):
    proc = _run(name, "--quick", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    if ENTRIES[name] is not None:
        with open(out / ENTRIES[name]) as f:
            assert json.load(f), f"{name}: an empty result"


def test_quick_report(out):
    proc = _run("report", "--quick", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert os.path.getsize(out / "REPORT.md") > 1000
