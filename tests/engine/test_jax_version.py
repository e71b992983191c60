"""The JAX releases revnet accepts (revnet/_engine/jaxpr/version.py)."""

import configparser
import os
import subprocess
import sys

import pytest

from revnet._engine.jaxpr import version
from tests.helpers import ROOT


@pytest.mark.parametrize(
    "v", ["0.10.0", "0.10.2", "0.11.2", "0.12.0.1", "0.12.7.dev20261101"]
)
def test_supported_releases_pass(v):
    assert version.unsupported(v) is None


@pytest.mark.parametrize("v", ["0.13.0", "0.9.2", "1.0.0", "0.4.30"])
def test_other_releases_are_refused_naming_the_range_and_the_pip_line(v):
    why = version.unsupported(v)
    assert why is not None and v in why and "jax>=0.10,<0.13" in why, why
    assert "pip install 'jax>=0.10,<0.13' 'jaxlib>=0.10,<0.13'" in why, why
    assert "\n" not in why


def test_setup_cfg_asks_for_the_python_the_oldest_jax_needs():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    assert cfg["options"]["python_requires"].strip() == ">=3.11"


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
    code = "import jax; jax.__version__ = '0.13.0'; import revnet"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: revnet supports jax>=0.10,<0.13"), last
    assert "found jax 0.13.0" in last
