"""The documentation site: its hooks, its build and how it renders.

``make docs`` builds ``site/`` in strict mode (CI runs it). Here the hooks are
checked on small inputs, so that a public name left off the API pages, a
missing docstring or a broken include fails the build; and in the slow tier
a copy of the sources with a broken link and a name off its API page must fail
to build, and the site is built and its pages opened in headless Chromium.
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import logging
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading
import types

import pytest

from tests.helpers import ROOT

pytest.importorskip("mkdocs", reason="the docs extra: pip install '.[docs]'")
HOOKS = pathlib.Path(ROOT) / "docs" / "hooks"
# As `make docs` builds. Not -q: in mkdocs 1.6 it lowers the log level to
# ERROR, and --strict then never sees a warning.
BUILD = [sys.executable, "-m", "mkdocs", "build", "--strict"]


def _build(root: str | pathlib.Path, out: pathlib.Path) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of the ``mkdocs.yml`` in ``root`` into ``out``."""
    return subprocess.run(
        [*BUILD, "-d", str(out)],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )


def _hook(name: str):
    spec = importlib.util.spec_from_file_location(f"hook_{name}", HOOKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Config:
    config_file_path = os.path.join(ROOT, "mkdocs.yml")


def _api_pages() -> str:
    return "\n".join(p.read_text() for p in (HOOKS.parent / "api").glob("*.md"))


def test_api_coverage_warns_of_each_public_name_on_no_page(caplog):
    hook = _hook("api_coverage")
    hook.on_config(_Config())
    pages = _api_pages()
    for left_out in ("revnet.scan", "revnet.nnx.ActNorm", "revnet.blocks.CONFIGS"):
        hook.on_pre_build(None)
        hook.on_page_markdown(pages.replace(f"::: {left_out}\n", ""), None, None, None)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            hook.on_post_build(None)
        assert [r.getMessage() for r in caplog.records] == [
            f"{left_out} is public but on no API page (add '::: {left_out}')"
        ]
    hook.on_pre_build(None)
    hook.on_page_markdown(pages, None, None, None)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        hook.on_post_build(None)
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_api_coverage_warns_of_a_name_without_a_docstring(caplog):
    hook = _hook("api_coverage")
    hook.on_config(_Config())
    module = types.ModuleType("documented_module")
    exec("def shown():\n    'A docstring.'\n\ndef bare():\n    pass\n", vars(module))
    module.__all__ = ["shown", "bare"]
    sys.modules[module.__name__] = module
    try:
        hook.on_pre_build(None)
        page = "::: documented_module.shown\n\n::: documented_module.bare\n"
        hook.on_page_markdown(page, None, None, None)
        with caplog.at_level(logging.WARNING):
            hook.on_post_build(None, modules=(module.__name__,))
    finally:
        del sys.modules[module.__name__]
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["documented_module.bare has no docstring"]


def test_doctest_runs_become_code_and_roles_inline_code():
    hook = _hook("docstrings")
    text = (
        "Calls :func:`invertible`, raising :class:`~revnet.NotInvertibleError`.\n"
        "\nExample:\n\n>>> x = 1\n... # more\n>>> x + 1\n2\n\nAfter."
    )
    want = (
        "Calls `invertible`, raising `NotInvertibleError`.\n"
        "\nExample:\n\n```pycon\n>>> x = 1\n... # more\n>>> x + 1\n2\n```\n\nAfter."
    )
    assert hook._ROLE.sub(hook._role, hook._fence(text)) == want


def test_includes_rewrite_root_links_and_refuse_what_is_missing(tmp_path):
    from mkdocs.exceptions import PluginError

    hook = _hook("repo_links")
    (tmp_path / "NOTES.md").write_text(
        "See [loops](docs/guides/loops.md).\n"
        "<!-- --8<-- [start:part] -->\n[How](CONTRIBUTING.md)\n"
        "<!-- --8<-- [end:part] -->\n"
    )

    class Config:
        config_file_path = str(tmp_path / "mkdocs.yml")

    page = '# P\n\n--8<-- "NOTES.md"\n\n--8<-- "NOTES.md:part"\n'
    got = hook.on_page_markdown(page, None, Config(), None)
    assert (
        "[loops](guides/loops.md)" in got and got.count("[How](contributing.md)") == 2
    )
    for missing in ('--8<-- "NOPE.md"', '--8<-- "NOTES.md:other"'):
        with pytest.raises(PluginError, match="no such"):
            hook.on_page_markdown(missing + "\n", None, Config(), None)


@pytest.mark.slow
def test_a_broken_link_or_a_name_on_no_api_page_fails_the_build(tmp_path):
    """A copy of the site's sources, with one link that goes nowhere and the
    ``::: revnet.scan`` line taken off its API page, does not build: strict
    mode counts both warnings and names each one."""
    copy = tmp_path / "repo"
    shutil.copytree(
        HOOKS.parent, copy / "docs", ignore=shutil.ignore_patterns("__pycache__")
    )
    pages = "\n".join(p.read_text() for p in (copy / "docs").rglob("*.md"))
    included = {m.group(1) for m in _hook("repo_links")._INCLUDE.finditer(pages)}
    assert "README.md" in included, included
    for name in ("mkdocs.yml", *included):
        shutil.copy(pathlib.Path(ROOT) / name, copy / name)
    (copy / "revnet").symlink_to(pathlib.Path(ROOT) / "revnet")  # mkdocstrings'
    with open(copy / "docs" / "limits.md", "a") as f:
        f.write("\nSee [the missing page](no-such-page.md).\n")
    api = copy / "docs" / "api" / "revnet.md"
    assert "\n::: revnet.scan\n" in api.read_text()
    api.write_text(api.read_text().replace("\n::: revnet.scan\n", "\n"))
    proc = _build(copy, tmp_path / "site")
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    assert re.search(r"WARNING.*'limits\.md'.*'no-such-page\.md'", log), log[-3000:]
    assert "revnet.scan is public but on no API page" in log, log[-3000:]
    assert "Aborted with 2 warnings in strict mode" in log, log[-3000:]


# --------------------------------------------------------------------------- #
# The built site, in a browser.


def _chromium() -> str | None:
    for name in ("chromium-headless-shell", "chromium", "chromium-browser"):
        if shutil.which(name):
            return shutil.which(name)
    for path in ("/usr/lib/chromium/chromium-headless-shell",):
        if os.path.exists(path):
            return path
    return None


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    proc = _build(ROOT, out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    handler = functools.partial(_QuietHandler, directory=str(out))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _render(url: str) -> tuple[str, str]:
    """The DOM after scripts ran, and Chromium's log (console messages)."""
    browser = _chromium()
    assert browser, "Chromium is missing: make test-all installs it (Makefile)"
    proc = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu",
         "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000",
         "--dump-dom", url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, proc.stderr


def _console_errors(log: str) -> list[str]:
    return [line for line in log.splitlines() if "CONSOLE" in line]


@pytest.mark.slow
def test_home_page_renders_without_console_errors(site):
    dom, log = _render(f"{site}/")
    assert re.search(r"<title>revnet</title>", dom), dom[:2000]
    assert "Reversible neural networks with invertible VJPs" in dom
    assert 'href="getting-started/"' in dom  # the navigation
    assert not _console_errors(log), _console_errors(log)


@pytest.mark.slow
def test_invertible_api_page_renders_its_signature(site):
    dom, log = _render(f"{site}/api/revnet/")
    assert re.search(r"<title>revnet - revnet</title>", dom), dom[:2000]
    heading = re.search(
        r'<h2 id="revnet\.invertible\.invertible"[^>]*>(.*?)</h2>', dom, re.S
    )
    assert heading and "invertible" in re.sub(r"<[^>]+>", "", heading.group(1))
    text = re.sub(r"<[^>]+>", "", dom)
    assert re.search(r"invertible\(\s*fun", text), "no signature"
    assert "known_argnums" in text
    # The docstring's example is a code block, not a nest of quotes.
    assert '<span class="gp">&gt;&gt;&gt; </span>' in dom, "no example code"
    assert "<blockquote>" not in dom
    assert not _console_errors(log), _console_errors(log)
