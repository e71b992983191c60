"""The JAX releases this package is written for, checked once at import.

JAX changes the internals read here between minor releases (JAX 0.11 gave
``scan`` new parameters and merged ``ClosedJaxpr`` into ``Jaxpr``), so under
a release it was not written for, revnet would fail deep inside a trace.
Importing this module (the first thing the package does) under a JAX outside
:data:`SUPPORTED` instead raises one error that names the supported range
and the pip line that installs it.
"""

from __future__ import annotations

import jax

# [lowest, first unsupported): JAX's (major, minor). setup.cfg pins the same.
SUPPORTED = ((0, 10), (0, 13))


def unsupported(version: str) -> str | None:
    """Why JAX ``version`` cannot run revnet, or None if it can.

    Args:
      version: A JAX version string, such as ``"0.10.2"`` or ``"0.11.0.dev1"``.

    Returns:
      A one-line message, or None for a version within :data:`SUPPORTED`.

    Example:
      >>> unsupported("0.10.2") is None
      True
    """
    try:
        got = tuple(int(p) for p in version.split(".")[:2])
    except ValueError:
        return f"revnet cannot read the JAX version {version!r}"
    (lo, hi) = SUPPORTED
    if lo <= got < hi:
        return None
    want = f"jax>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}"
    return (
        f"revnet supports {want}, found jax {version}: revnet reads JAX's "
        f"program internals, which change between minor releases. Try: "
        f"pip install '{want}' 'jaxlib{want[3:]}'"
    )


def check() -> None:
    """Raises ImportError if the installed JAX is outside :data:`SUPPORTED`."""
    why = unsupported(jax.__version__)
    if why is not None:
        raise ImportError(why)


check()
