"""The front doors' frameworks are extras: a missing one is named in one line."""

from __future__ import annotations

# Each front door: the module it imports first, the distribution that provides
# it, and revnet's extra that installs it (setup.cfg's extras_require).
DOORS = {
    "revnet.blocks": ("haiku", "dm-haiku", "haiku"),
    "revnet.nnx": ("flax.nnx", "flax", "nnx"),
    "revnet.eqx": ("equinox", "equinox", "equinox"),
}


def message(door: str) -> str:
    """The one line a front door raises when its framework is missing."""
    _, distribution, extra = DOORS[door]
    return (
        f"{door} needs {distribution}: pip install {distribution}, "
        f"or '.[{extra}]' in a clone of revnet"
    )


def missing_extra(door: str, error: ImportError) -> ImportError:
    """The error to raise when importing ``door``'s framework raised ``error``.

    The framework itself missing (or a submodule of it, as an older release
    lacks) becomes one line naming the extra; an error from inside an installed
    framework (one of its own dependencies missing) is returned as it is. Use
    it as ``raise missing_extra(__name__, e) from None``.
    """
    module = DOORS[door][0]
    if error.name is None or error.name.split(".")[0] != module.split(".")[0]:
        return error
    return ImportError(message(door))
