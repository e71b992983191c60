"""The JAX releases revnet accepts (revnet/_engine/jaxpr/version.py)."""

import configparser
import os
import subprocess
import sys

import pytest

from revnet._engine.jaxpr import version
from tests.helpers import ROOT


@pytest.mark.parametrize("v", ["0.10.0", "0.10.2", "0.10.7.dev20261101"])
def test_supported_releases_pass(v):
    assert version.unsupported(v) is None


@pytest.mark.parametrize("v", ["0.11.2", "0.9.2", "1.0.0", "0.4.30"])
def test_other_releases_are_refused_naming_both_versions(v):
    why = version.unsupported(v)
    assert why is not None and v in why and "jax>=0.10,<0.11" in why, why
    assert "\n" not in why


def test_an_unreadable_version_is_refused():
    assert "cannot read" in version.unsupported("main")


def test_setup_cfg_pins_the_same_range():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    pins = {
        line.split(">=")[0]: line.strip()
        for line in cfg["options"]["install_requires"].splitlines()
        if ">=" in line
    }
    (lo, hi) = version.SUPPORTED
    want = f">={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}"
    assert pins["jax"] == "jax" + want, pins
    assert pins["jaxlib"] == "jaxlib" + want, pins


def test_importing_under_another_jax_raises_one_clear_error():
    code = "import jax; jax.__version__ = '0.11.2'; import revnet"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: revnet supports jax>=0.10,<0.11"), last
    assert "found jax 0.11.2" in last
