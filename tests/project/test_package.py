"""The installable package: its version, and the wheel and sdist `python -m build`
makes, installed into a clean virtual environment with and without each extra."""

from __future__ import annotations

import configparser
import email
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

import revnet
from tests.helpers import ROOT

# Each front door, the extra that installs its framework, and the one line it
# raises without it.
DOORS = {
    "revnet.blocks": (
        "haiku",
        "revnet.blocks needs dm-haiku: "
        "pip install dm-haiku, or '.[haiku]' in a clone of revnet",
    ),
    "revnet.nnx": (
        "nnx",
        "revnet.nnx needs flax: pip install flax, or '.[nnx]' in a clone of revnet",
    ),
    "revnet.eqx": (
        "equinox",
        "revnet.eqx needs equinox: "
        "pip install equinox, or '.[equinox]' in a clone of revnet",
    ),
}
# Pinned in the clean environment to the versions this suite runs with, where
# installed here: the same JAX is tested, and pip can reuse its cache.
PINNED = ("jax", "jaxlib", "numpy", "dm-haiku", "flax", "equinox")
# What only the repository holds: neither the sdist nor the wheel carries it.
REPO_ONLY = ("tests/", "benchmarks/", "examples/", "experiments/", "Makefile")


def _released_versions() -> list[str]:
    with open(os.path.join(ROOT, "CHANGELOG.md")) as f:
        return re.findall(r"^## \[(\d[^\]]*)\] - \d{4}-\d\d-\d\d$", f.read(), re.M)


def test_version_is_the_changelogs_latest_and_the_installed_metadatas():
    with open(os.path.join(ROOT, "setup.cfg")) as f:
        assert "version = attr: revnet.__version__" in f.read()
    assert re.fullmatch(r"\d+\.\d+\.\d+", revnet.__version__)
    released = _released_versions()
    assert released and released[0] == revnet.__version__, released
    try:
        installed = importlib.metadata.version("revnet")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("revnet is not installed (make test installs it editable)")
    assert installed == revnet.__version__


def test_licence_is_apache_2_0_and_the_metadata_says_so():
    """LICENSE holds the Apache License 2.0 text, and every licence the
    package declares (setup.cfg, pyproject.toml, classifiers) is Apache-2.0."""
    with open(os.path.join(ROOT, "LICENSE")) as f:
        lines = [line.strip() for line in f]
    title = lines.index("Apache License")
    assert lines[title + 1] == "Version 2.0, January 2004", lines[title : title + 2]
    assert "http://www.apache.org/licenses/" in lines[title + 2 : title + 4]
    terms = lines.index("TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION")
    assert title < terms < lines.index("END OF TERMS AND CONDITIONS")
    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, "setup.cfg"))
    metadata = dict(config["metadata"]) if config.has_section("metadata") else {}
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        project = re.search(r"^\[project\]\n(.*?)(?=^\[|\Z)", f.read(), re.M | re.S)
    declared = [metadata.get("license")]
    if project:  # license = "Apache-2.0", or the older { text = "Apache-2.0" }
        found = re.search(r'^license\s*=\s*(?:\{\s*text\s*=\s*)?"([^"]*)"',
                          project.group(1), re.M)  # fmt: skip
        declared.append(found and found.group(1))
    declared = [d for d in declared if d]
    assert declared and set(declared) == {"Apache-2.0"}, declared
    classifiers = metadata.get("classifiers", "") + (project and project.group(1) or "")
    licences = re.findall(r"License :: [^\n\"]+", classifiers)
    assert set(licences) <= {"License :: OSI Approved :: Apache Software License"}
    if "license_files" in metadata:
        assert "LICENSE" in metadata["license_files"].split()


# --------------------------------------------------------------------------- #
# The slow test: build, then install into a clean virtual environment.

# Run in the clean environment, from outside the checkout: which revnet is
# imported, its version, a gradient through revnet.invertible, which
# frameworks are importable, and what each front door's import gives.
PROBE = """
import importlib, importlib.metadata, importlib.util, json, sys
import jax, jax.numpy as jnp
import revnet

FRAMEWORKS = ("haiku", "flax", "equinox")

@revnet.invertible
def f(a, b):
    a = a + jnp.tanh(b)
    return a, b + jnp.tanh(a)

def loss(x, fn):
    return jnp.sum(fn(x, 2 * x)[1] ** 2)

x = jnp.linspace(-1.0, 1.0, 4)
grad, plain = jax.grad(loss)(x, f), jax.grad(loss)(x, f.__wrapped__)
doors = {}
for door in sys.argv[1:]:
    try:
        importlib.import_module(door)
        doors[door] = "ok"
    except ImportError as e:
        doors[door] = str(e)
print(json.dumps({
    "file": revnet.__file__,
    "version": revnet.__version__,
    "metadata": importlib.metadata.version("revnet"),
    # float32, as tests/helpers.py's "autodiff" rtol and "values" atol (the
    # clean environment has no tests/ to import them from)
    "grad": bool(jnp.allclose(grad, plain, rtol=1e-5, atol=1e-6)),
    "frameworks": [m for m in FRAMEWORKS if importlib.util.find_spec(m)],
    "doors": doors,
}))
"""


def _run(argv, cwd, env, timeout=900):
    proc = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, (argv, proc.stdout[-3000:], proc.stderr[-3000:])
    return proc.stdout


def _source_copy(dest: str) -> list[str]:
    """The checkout's files (tracked, and new ones git does not ignore) in ``dest``,
    so that building writes its build/ and revnet.egg-info there, not here."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the source tree to build is not known")
    files = [f for f in listed.decode().split("\0") if f]
    files = [f for f in files if os.path.isfile(os.path.join(ROOT, f))]
    for name in files:
        os.makedirs(os.path.join(dest, os.path.dirname(name)), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, name), os.path.join(dest, name))
    return files


def _check_sdist(path: str, package_files: set[str]) -> None:
    top = f"revnet-{revnet.__version__}/"
    with tarfile.open(path) as tar:
        every = tar.getnames()
    assert all(n.startswith(top) or n == top[:-1] for n in every), every
    names = [n[len(top) :] for n in every if n.startswith(top)]
    for name in ("LICENSE", "README.md", "CHANGELOG.md", "PKG-INFO"):
        assert name in names, name
    assert {"pyproject.toml", "setup.cfg"} <= set(names)
    assert {n for n in names if n.startswith("revnet/")} >= package_files
    assert not [n for n in names if n.startswith(REPO_ONLY)], names


def _check_wheel(path: str, package_files: set[str]) -> None:
    info = f"revnet-{revnet.__version__}.dist-info/"
    with zipfile.ZipFile(path) as whl:
        names = whl.namelist()
        metadata = email.message_from_bytes(whl.read(info + "METADATA"))
    assert {n for n in names if not n.startswith(info)} == package_files
    assert [n for n in names if n.startswith(info) and n.endswith("/LICENSE")]
    assert metadata["Version"] == revnet.__version__
    requires = metadata.get_all("Requires-Dist")
    core = {re.match(r"[\w-]+", r)[0] for r in requires if "extra ==" not in r}
    assert core == {"jax", "jaxlib", "numpy"}, requires
    assert {"haiku", "nnx", "equinox"} <= set(metadata.get_all("Provides-Extra"))


@pytest.mark.slow
def test_wheel_and_sdist_install_into_a_clean_environment(tmp_path):
    before = _build_outputs()
    src, dist, venv = (str(tmp_path / d) for d in ("src", "dist", "venv"))
    files = _source_copy(src)
    package_files = {f for f in files if f.startswith("revnet/")}
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
    }

    # A clean environment: `python -m venv` without the system's packages.
    _run([sys.executable, "-m", "venv", venv], tmp_path, env)
    python = os.path.join(venv, "bin", "python")
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run([*pip, "build"], tmp_path, env)
    _run([python, "-m", "build", "--outdir", dist, src], tmp_path, env)
    version = revnet.__version__
    sdist = os.path.join(dist, f"revnet-{version}.tar.gz")
    wheel = os.path.join(dist, f"revnet-{version}-py3-none-any.whl")
    assert sorted(os.listdir(dist)) == sorted(map(os.path.basename, (sdist, wheel)))
    _check_sdist(sdist, package_files)
    _check_wheel(wheel, package_files)
    assert _build_outputs() == before  # none made here

    pins = [
        f"{name}=={importlib.metadata.version(name)}"
        for name in PINNED
        if _installed(name)
    ]
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("\n".join(pins) + "\n")
    pip += ["-c", str(constraints)]
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)

    def check(installed: set[str]) -> dict:
        out = _run([python, "-I", str(probe), *DOORS], tmp_path, env)
        result = json.loads(out.splitlines()[-1])
        assert result["file"].startswith(venv), result["file"]  # not the checkout
        assert result["version"] == result["metadata"] == version, result
        assert result["grad"], result
        for door, (extra, line) in DOORS.items():
            assert result["doors"][door] == ("ok" if extra in installed else line)
        return result

    # The core alone: jax, jaxlib and numpy; no front door's framework.
    _run([*pip, wheel], tmp_path, env)
    assert check(set())["frameworks"] == []
    # Each extra in turn, into the same environment: its front door imports.
    installed = set()
    for extra in ("haiku", "nnx", "equinox"):
        _run([*pip, f"{wheel}[{extra}]"], tmp_path, env)
        installed.add(extra)
        check(installed)
    assert _build_outputs() == before


def _build_outputs() -> list[str]:
    """What building in the checkout would leave there (.gitignore ignores it)."""
    names = os.listdir(ROOT)
    return sorted(n for n in names if n in ("build", "dist") or n.endswith(".egg-info"))


def _installed(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_help_names_every_front_door_and_its_framework():
    """``help(revnet)`` shows the package docstring: it names every front door
    and its framework, not Haiku's alone."""
    text = " ".join(revnet.__doc__.split())
    for framework, module in (
        ("Haiku", "revnet.blocks"),
        ("Flax NNX", "revnet.nnx"),
        ("Equinox", "revnet.eqx"),
    ):
        assert re.search(rf"{framework}: :mod:`{re.escape(module)}`", text), module
