"""The user's source line of an equation, past library frames."""

from __future__ import annotations

import importlib.util
import os
import re
import sys

import jax

from revnet._engine.jaxpr.atoms import JaxprEqn

try:  # jax >= 0.4.36
    from jax.extend import source_info_util as _siu
except ImportError:  # pragma: no cover - older JAX
    _siu = None


_JAX_DIR = os.path.dirname(jax.__file__)
# This file is revnet/_engine/jaxpr/source.py.
_REVNET_DIR = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)
if _siu is not None and hasattr(_siu, "register_exclusion"):
    # Frames inside revnet are library frames: name the user's call site instead.
    _siu.register_exclusion(_REVNET_DIR + os.sep)


def _library_dirs() -> tuple[str, ...]:
    """JAX's, revnet's and Haiku's folders: frames there are not the user's."""
    dirs = [_JAX_DIR, _REVNET_DIR]
    spec = importlib.util.find_spec("haiku")
    if spec is not None and spec.origin:
        dirs.append(os.path.dirname(spec.origin))
    return tuple(dirs)


_LIBRARY_DIRS = _library_dirs()


def where(eqn: JaxprEqn) -> str:
    """The user's source line of ``eqn``, or ``""`` when it has only library frames.

    Frames inside JAX, revnet and Haiku (a module's method interception) are
    skipped, so an equation made inside a Haiku module names the user's line.
    """
    if _siu is None:  # pragma: no cover
        return ""
    try:
        summary = _siu.summarize(eqn.source_info)
    except Exception:  # pragma: no cover - defensive: never fail an error message
        return ""
    if summary and not summary.startswith(_LIBRARY_DIRS):
        return summary
    frames = getattr(getattr(eqn.source_info, "traceback", None), "frames", ())
    for f in frames:  # innermost first
        if not os.path.abspath(f.file_name).startswith(_LIBRARY_DIRS):
            return f"{f.file_name}:{f.line_num} ({f.function_name})"
    return ""


def caller_site() -> str:
    """``file:line (function)`` of the innermost frame outside revnet and JAX."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_LIBRARY_DIRS):
            return f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return ""


_LINE = re.compile(r"^(?P<file>.*?):(?P<line>\d+)(?::\d+)? \(")


def site_line(site: str) -> tuple[str, int]:
    """``(file, line)`` of a site ``file:line[:column] (function)`` (as
    :func:`where` and :func:`caller_site` give), for
    :func:`warnings.warn_explicit`; ``("<revnet>", 0)`` for ``""``."""
    m = _LINE.match(site)
    return (m["file"], int(m["line"])) if m else (site or "<revnet>", 0)
