"""MkDocs hook: every public name is on an API page, with a docstring.

The API pages name objects with mkdocstrings' ``::: path`` lines. After the
build, every name in the ``__all__`` of the documented modules must be the
object of one of those lines (``revnet.invertible`` is also a submodule's name,
so its page names ``revnet.invertible.invertible``), and must have a docstring
(for data, the docstring under its assignment, read by griffe as mkdocstrings
reads it). Each miss is a warning, which ``strict: true`` turns into a failed
build.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import re
import sys

MODULES = (
    "revnet",
    "revnet.flows",
    "revnet.exact",
    "revnet.blocks",
    "revnet.nnx",
    "revnet.eqx",
)
log = logging.getLogger("mkdocs.hooks.api_coverage")
_named: set[str] = set()
_root: list[str] = []


def on_config(config):
    """Imports revnet from this checkout, as mkdocstrings reads it."""
    _root[:] = [os.path.dirname(os.path.abspath(config.config_file_path))]
    sys.path.insert(0, _root[0])
    return config


def on_pre_build(config) -> None:
    _named.clear()


def on_page_markdown(markdown: str, page, config, files) -> str:
    _named.update(re.findall(r"^:::\s+([\w.]+)", markdown, re.M))
    return markdown


def _resolve(path: str):
    """The object that ``path`` (``package.module.name``) names."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _has_docstring(module: str, name: str, obj) -> bool:
    if inspect.isclass(obj) or callable(obj):
        return bool(inspect.getdoc(obj))
    import griffe  # data: the docstring under the assignment

    found = griffe.load(module, search_paths=_root, resolve_aliases=True)[name]
    return bool(found.docstring and found.docstring.value.strip())


def on_post_build(config, modules: tuple[str, ...] = MODULES) -> None:
    documented = {id(_resolve(path)) for path in _named}
    for module_name in modules:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj, path = getattr(module, name), f"{module_name}.{name}"
            if id(obj) not in documented:
                log.warning(f"{path} is public but on no API page (add '::: {path}')")
            elif not _has_docstring(module_name, name, obj):
                log.warning(f"{path} has no docstring")
