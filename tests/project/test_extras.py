"""The front doors name the extra to install when their framework is missing
(without Flax and Equinox ``make test`` passes: their tests skip); the core
imports none of the three."""

from __future__ import annotations

import subprocess
import sys

import pytest

from revnet import _extras
from tests.helpers import ROOT

# Front door module, the package it imports, and the line it raises without it.
DOORS = [
    (
        "revnet.blocks",
        "haiku",
        "revnet.blocks needs dm-haiku: "
        "pip install dm-haiku, or '.[haiku]' in a clone of revnet",
    ),
    (
        "revnet.eqx",
        "equinox",
        "revnet.eqx needs equinox: "
        "pip install equinox, or '.[equinox]' in a clone of revnet",
    ),
    (
        "revnet.nnx",
        "flax",
        "revnet.nnx needs flax: pip install flax, or '.[nnx]' in a clone of revnet",
    ),
]


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT
    )


@pytest.mark.parametrize("module, package, line", DOORS)
def test_missing_framework_is_named_in_one_line(module, package, line):
    others = ", ".join(m for m, _, _ in DOORS if m != module)
    code = (
        f"import sys; sys.modules[{package!r}] = None\n"
        "try:\n"
        f"    import {module}\n"
        "except ImportError as e:\n"
        "    print(e)\n"
        f"import revnet, revnet.flows, {others}  # the rest still imports\n"
    )
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == line + "\n"
    assert line == _extras.message(module)


def test_the_core_imports_no_framework():
    # Every module outside the three front doors imports, and differentiates,
    # with Haiku, Flax and Equinox blocked.
    code = (
        "import sys\n"
        "for name in ('haiku', 'flax', 'equinox'):\n"
        "    sys.modules[name] = None\n"
        "import importlib, pkgutil\n"
        "import jax, jax.numpy as jnp, revnet\n"
        "doors = ('revnet.blocks', 'revnet.nnx', 'revnet.eqx')\n"
        "names = [m.name for m in pkgutil.walk_packages(revnet.__path__, 'revnet.')\n"
        "         if not m.name.startswith(doors)]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "f = revnet.invertible(lambda a, b: (a + jnp.tanh(b), b))\n"
        "g = jax.grad(lambda x: jnp.sum(f(x, x)[0] ** 2))(jnp.ones(3))\n"
        "assert g.shape == (3,), g\n"
        "print(len(names))\n"
    )
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout) > 20  # revnet.flows, revnet.rules, revnet._engine...


def test_an_error_inside_an_installed_framework_is_not_reworded():
    # flax installed, one of its own dependencies missing: that error goes up.
    inner = ModuleNotFoundError("No module named 'msgpack'", name="msgpack")
    assert _extras.missing_extra("revnet.nnx", inner) is inner
    old = ModuleNotFoundError("No module named 'flax.nnx'", name="flax.nnx")
    assert str(_extras.missing_extra("revnet.nnx", old)) == DOORS[2][2]


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
        "'tests/project/test_docs.py']))\n"
    )
    proc = _run(code)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert " passed" not in proc.stdout and " failed" not in proc.stdout
    for package, extra in (("flax", "nnx"), ("equinox", "equinox")):
        assert f"pip install '.[{extra}]'" in proc.stdout, (package, proc.stdout)
