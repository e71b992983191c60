"""MkDocs hook: pages that include files from the repository's root.

A line ``--8<-- "CONTRIBUTING.md"`` in a page is replaced by that file, and
``--8<-- "README.md:quickstart"`` by the README's lines between
``<!-- --8<-- [start:quickstart] -->`` and ``<!-- --8<-- [end:quickstart] -->``,
so that each text is written once. Those files link as files in the root do
(``docs/guides/loops.md``, ``CONTRIBUTING.md``); on the site the same links
are relative to ``docs/``, so they are rewritten before MkDocs checks them. A
missing file or section fails the build.
"""

from __future__ import annotations

import os
import re

from mkdocs.exceptions import PluginError

_INCLUDE = re.compile(r'^--8<-- "([\w.-]+)(?::([\w-]+))?"[ \t]*$', re.M)
_DOCS_LINK = re.compile(r"\]\(docs/([^)]+)\)")


def _read(root: str, name: str, section: str | None) -> str:
    path = os.path.join(root, name)
    if not os.path.isfile(path):
        raise PluginError(f"--8<-- {name!r}: no such file in {root}")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if section is None:
        return text
    found = re.search(
        rf"<!-- --8<-- \[start:{section}\] -->\n(.*?)<!-- --8<-- \[end:{section}\] -->",
        text,
        re.S,
    )
    if found is None:
        raise PluginError(f"--8<-- {name}:{section}: no such section in {name}")
    return found.group(1)


def _as_page(text: str) -> str:
    text = _DOCS_LINK.sub(r"](\1)", text)
    return text.replace("](CONTRIBUTING.md)", "](contributing.md)")


def on_page_markdown(markdown: str, page, config, files) -> str:
    root = os.path.dirname(os.path.abspath(config.config_file_path))
    return _INCLUDE.sub(lambda m: _as_page(_read(root, *m.groups())), markdown)
