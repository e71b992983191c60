"""A griffe extension: revnet's docstrings as mkdocstrings renders them.

The docstrings are written for ``help()`` and doctest: an ``Example:`` line
followed by ``>>>`` lines at the docstring's own indentation, and Sphinx roles
(:func:`invertible`). Markdown would read the prompts as nested quotes and
the roles as text, so each run of doctest lines (prompts, continuations and
their output, up to a blank line) becomes a fenced ``pycon`` block, and each
role becomes inline code. reST's ``Example::`` loses its second colon (the
indented block after it is already code in Markdown).
"""

from __future__ import annotations

import re

import griffe

_LITERAL = re.compile(r"(\S)::$", re.M)  # reST's "Example::" before a code block
_ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|obj|exc):`(~?)([^`]+)`")


def _fence(text: str) -> str:
    out, block = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith(">>>") or (block and line.strip()):
            block.append(line)
            continue
        if block:
            out += ["```pycon", *block, "```"]
            block = []
        out.append(line)
    return "\n".join(out[:-1])


def _role(match: re.Match) -> str:
    short, name = match.groups()  # `~a.b.c` shows `c`, as Sphinx does
    return f"`{name.rsplit('.', 1)[-1] if short else name}`"


class DoctestFences(griffe.Extension):
    """Fences doctest runs and turns Sphinx roles into inline code."""

    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            text = _LITERAL.sub(r"\1:", _fence(obj.docstring.value))
            obj.docstring.value = _ROLE.sub(_role, text)
