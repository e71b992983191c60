"""The one check only Haiku modules need: a module's ``name``."""

from __future__ import annotations

from typing import Any

from revnet._checks import fail


def check_name(cls: type, name: Any) -> None:
    """Checks a module's ``name`` before ``hk.Module.__init__`` sees it.

    Haiku itself rejects strings that are not identifiers; anything that is not
    a string fails inside Haiku with an unrelated message.

    Raises:
      TypeError: If ``name`` is neither a string nor None.
    """
    if name is not None and not isinstance(name, str):
        raise fail(cls.__name__, "name", name, "a string or None")
