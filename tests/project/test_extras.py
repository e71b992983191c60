"""The optional front doors name the extra to install when their framework is
missing (``make test`` passes without them: their tests skip)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT

# Front door module, the package it needs, and the extra that installs it.
DOORS = [("revnet.eqx", "equinox", "equinox"), ("revnet.nnx", "flax", "nnx")]


@pytest.mark.parametrize("module, package, extra", DOORS)
def test_missing_framework_is_named_in_one_line(module, package, extra):
    code = (
        f"import sys; sys.modules[{package!r}] = None\n"
        "try:\n"
        f"    import {module}\n"
        "except ImportError as e:\n"
        "    print(e)\n"
        "import revnet, revnet.blocks  # the rest still imports\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == f"{module} needs {package}: pip install 'revnet[{extra}]'\n"


def test_without_the_frameworks_their_tests_skip_naming_the_extra():
    # `make test` on an install without flax and equinox: the front doors'
    # tests are skipped with the reason, none fails.
    code = (
        "import sys; sys.modules['flax'] = sys.modules['equinox'] = None\n"
        "import pytest\n"
        "sys.exit(pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', '-m', "
        "'not slow', '-k', 'nnx or equinox or eqx or Flax or Equinox', "
        "'tests/doors/nnx/test_nnx.py', 'tests/doors/equinox/test_eqx.py', "
        "'tests/doors/test_table.py', "
        "'tests/project/test_readme.py']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert " passed" not in proc.stdout and " failed" not in proc.stdout
    for package, extra in (("flax", "nnx"), ("equinox", "equinox")):
        assert f"pip install 'revnet[{extra}]'" in proc.stdout, (package, proc.stdout)
