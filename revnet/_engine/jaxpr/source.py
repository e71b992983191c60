"""The user's source line of an equation, past library frames.

Frames inside JAX, revnet and Haiku are never the user's. Frames inside other
installed packages (``site-packages``: jax-md, diffrax, equinox) are the
*library's*: :func:`where` names the user's line that called into them, and
:func:`library_where` the innermost line inside them, where the equation was
made.
"""

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
    # With the separator: jax-md's folder, ``jax_md``, is not inside ``jax``.
    return tuple(os.path.join(d, "") for d in dirs)


# The folders installed packages live in: frames there are a library's.
_PACKAGE_FOLDERS = tuple(
    os.sep + name + os.sep for name in ("site-packages", "dist-packages")
)


def _in_package(path: str) -> bool:
    """Whether ``path`` is inside an installed package (not revnet's own
    folder, which may be installed too)."""
    return any(f in path for f in _PACKAGE_FOLDERS) and not path.startswith(
        _LIBRARY_DIRS
    )


_LIBRARY_DIRS = _library_dirs()


def _frames(eqn: JaxprEqn) -> list[tuple[str, str]]:
    """``(path, "file:line (function)")`` of ``eqn``'s frames outside JAX,
    revnet and Haiku, innermost first."""
    frames = getattr(getattr(eqn.source_info, "traceback", None), "frames", ())
    out = []
    for f in frames or ():
        path = os.path.abspath(f.file_name)
        if not path.startswith(_LIBRARY_DIRS):
            out.append((path, f"{f.file_name}:{f.line_num} ({f.function_name})"))
    return out


def library_where(eqn: JaxprEqn) -> str:
    """The innermost line of ``eqn`` inside an installed package other than
    JAX, revnet and Haiku (``jax_md/space.py:110 (periodic_shift)``), or ``""``
    when it was made in the user's own code."""
    try:
        frames = _frames(eqn)
    except Exception:  # pragma: no cover - defensive: never fail an error message
        return ""
    if frames and _in_package(frames[0][0]):
        return frames[0][1]
    return ""


def where(eqn: JaxprEqn) -> str:
    """The user's source line of ``eqn``, or ``""`` when it has only library
    frames.

    Frames inside JAX, revnet and Haiku (a module's method interception) are
    skipped, so an equation made inside a Haiku module names the user's line;
    so are those in other installed packages while a user's frame calls them
    (:func:`library_where` names the package's line).
    """
    if _siu is None:  # pragma: no cover
        return ""
    try:
        summary = _siu.summarize(eqn.source_info)
    except Exception:  # pragma: no cover - defensive: never fail an error message
        return ""
    try:
        frames = _frames(eqn)
    except Exception:  # pragma: no cover
        frames = []
    if summary and not summary.startswith(_LIBRARY_DIRS) and not _in_package(summary):
        return summary  # JAX's own summary, with its column
    for path, text in frames:  # innermost first: past installed packages
        if not _in_package(path):
            return text
    # Only library frames: inside a package's own ``jit``, whose equations'
    # frames end at that function; the call around it has the user's line.
    return ""


def caller_site() -> str:
    """``file:line (function)`` of the innermost frame outside revnet and JAX
    (and, where the user's own code calls them, installed packages)."""
    frame, first = sys._getframe(1), ""
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_LIBRARY_DIRS):
            text = f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"
            if not _in_package(path):
                return text
            first = first or text
        frame = frame.f_back
    return first


_LINE = re.compile(r"^(?P<file>.*?):(?P<line>\d+)(?::\d+)? \(")


def site_line(site: str) -> tuple[str, int]:
    """``(file, line)`` of a site ``file:line[:column] (function)`` (as
    :func:`where` and :func:`caller_site` give), for
    :func:`warnings.warn_explicit`; ``("<revnet>", 0)`` for ``""``."""
    m = _LINE.match(site)
    return (m["file"], int(m["line"])) if m else (site or "<revnet>", 0)
