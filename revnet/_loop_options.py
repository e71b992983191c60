"""The options of ``revnet.while_loop`` and ``revnet.scan``, checked once.

:func:`while_options` and :func:`scan_options` check what the front-ends in
:mod:`revnet.loops` were given, with the one-line errors of
:mod:`revnet._checks`, and return one frozen :class:`Options`: the backward
mode, the number of snapshots, the anchors (the initial carry alone when
only the boundary check or a drift monitor asks for one), the storage of
decisions and kinks, and a scan's ``xs``.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from revnet._checks import (
    check_bool,
    check_callable,
    check_int,
    check_monitor,
    fail,
    one_of,
)
from revnet._engine import (
    INT32_MAX,
    Storage,
    boundary,
    choose,
    revolve,
)
from revnet.drift import DriftMonitor

WHILE, SCAN = "while_loop", "scan"
_BOOLS = (bool, np.bool_)


# --------------------------------------------------------------------------- #
# Options.

_NON_NEGATIVE = "a non-negative integer known at trace time (a Python or NumPy integer)"
_POSITIVE = "a positive integer known at trace time, or None"


class Default(str):
    """The default of ``mode=`` (``"auto"``), told apart from ``"auto"`` given."""


AUTO = Default(choose.AUTO)

# A sentinel: ``invert=`` was not given.
UNSET: Any = object()

_FROM_INVERT = {None: choose.AUTO, True: choose.INVERT, False: choose.CHECKPOINT}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """A loop's options, checked.

    ``bound`` is a while loop's ``max_steps`` (or None) and a scan's number of
    steps; ``slots`` the number of snapshots when checkpointing;
    ``anchor_every`` the anchor interval (the whole loop when only ``drift``
    asks for anchors); ``storage`` what is stored per step besides the carry
    (decisions, kinks). A scan's ``xs`` are arrays, with their ``x_tree``, and
    ``again`` holds its keyword options, to make it again under ``jax.vmap``.
    ``check`` is the boundary check's mode for this loop when it is not the
    setting's (armed against damping: :func:`revnet._loop_common.armed`).
    """

    loop: str
    bound: int | None
    slots: int
    mode: str
    anchor_every: int | None
    drift: DriftMonitor | None
    storage: Storage
    reverse: bool = False
    unroll: int | bool = 1
    xs: list = dataclasses.field(default_factory=list)
    x_tree: Any = None
    again: dict = dataclasses.field(default_factory=dict)
    check: str | None = None


def _positive(where: str, arg: str, value: Any, minimum: int = 1) -> int | None:
    """None, or ``value`` checked to be a positive (``minimum=0``: non-negative)
    integer."""
    if value is None:
        return None
    if minimum == 0:
        return check_int(where, arg, value, 0, _NON_NEGATIVE, "non-negative")
    return check_int(where, arg, value, 1, _POSITIVE, "at least 1")


def check_checkpoints(where: str, checkpoints: Any, bound: int | None) -> int:
    """The number of snapshots: ``checkpoints`` checked, or the default."""
    if checkpoints is None:
        return revolve.default_slots(bound)
    n = _positive(where, "checkpoints", checkpoints)
    # More snapshots than steps are never used.
    return n if bound is None else max(1, min(n, bound + 1))


def _mode(where: str, mode: Any, invert: Any) -> str:
    """The backward mode from ``mode=`` and the deprecated ``invert=``."""
    if invert is not UNSET:
        if mode is not AUTO:
            raise TypeError(
                f"{where}: got both invert= and mode=; invert= is deprecated, "
                "give mode= only"
            )
        if not (invert is None or isinstance(invert, _BOOLS)):
            raise fail(where, "invert", invert, "None (automatic), True or False")
        mode = _FROM_INVERT[None if invert is None else bool(invert)]
        warnings.warn(
            f"{where}: invert={invert!r} is deprecated; use mode={mode!r}",
            DeprecationWarning,
            stacklevel=4,
        )
    if not isinstance(mode, str) or mode not in choose.MODES:
        raise fail(where, "mode", mode, one_of(choose.MODES), ValueError)
    return str(mode)


def _shared(
    loop: str,
    bound: int | None,
    *,
    checkpoints: Any,
    mode: Any,
    invert: Any,
    anchor_every: Any,
    drift: Any,
    **storage: Any,
) -> dict:
    """The options both loops take, checked: :class:`Options`' fields
    (``storage``: the fields of :class:`revnet._engine.Storage`, as given)."""
    return dict(
        loop=loop,
        bound=bound,
        storage=Storage.checked(loop, **storage),
        mode=_mode(loop, mode, invert),
        anchor_every=_positive(loop, "anchor_every", anchor_every),
        drift=check_monitor(loop, "drift", drift),
        slots=check_checkpoints(loop, checkpoints, bound),
    )


def while_options(
    cond_fun: Any, body_fun: Any, max_steps: Any, **shared: Any
) -> Options:
    """The options of ``revnet.while_loop`` checked, as it was given them
    (``shared``: the keyword options both loops take); ``bound`` is
    ``max_steps``."""
    check_callable(WHILE, "cond_fun", cond_fun)
    check_callable(WHILE, "body_fun", body_fun)
    bound = _positive(WHILE, "max_steps", max_steps, 0)
    if bound is not None and bound > INT32_MAX:
        raise fail(WHILE, "max_steps", bound, f"at most {INT32_MAX}", ValueError)
    o = _shared(WHILE, bound, **shared)
    if o["mode"] == "store" and bound is None:
        raise ValueError(
            "while_loop: mode='store' stores carry leaves at every step and needs "
            "max_steps (room for that many steps); give max_steps, or use "
            "mode='checkpoint'"
        )
    if o["anchor_every"] is not None and bound is None:
        raise ValueError(
            "while_loop: anchor_every needs max_steps (room for the anchors is "
            f"made for max_steps steps), got anchor_every={o['anchor_every']} and "
            "max_steps=None"
        )
    if (o["drift"] is not None or boundary.active()) and o["anchor_every"] is None:
        o["anchor_every"] = INT32_MAX if bound is None else max(bound, 1)
    return Options(**o)


def scan_options(
    f: Any, xs: Any, length: Any, reverse: Any, unroll: Any, **shared: Any
) -> Options:
    """The options of ``revnet.scan`` checked, as :func:`while_options`;
    ``bound`` is the number of steps, from ``length`` and ``xs``."""
    check_callable(SCAN, "f", f)
    length = _positive(SCAN, "length", length, 0)
    expected = "a bool known at trace time (True or False)"
    reverse = check_bool(SCAN, "reverse", reverse, expected)
    if isinstance(unroll, _BOOLS):
        unroll = bool(unroll)
    else:
        expected = "a bool or a non-negative integer known at trace time"
        unroll = check_int(SCAN, "unroll", unroll, 0, expected)
    x_leaves, x_tree = jax.tree_util.tree_flatten(xs)
    x_leaves = [jnp.asarray(x) for x in x_leaves]
    n = _scan_length(x_leaves, length)
    o = _shared(SCAN, n, **shared)
    # Its keyword options, checked, to make it again under jax.vmap.
    again = {k: o[k] for k in ("mode", "anchor_every", "drift")}
    again |= dict(checkpoints=shared["checkpoints"], **dataclasses.asdict(o["storage"]))
    if (o["drift"] is not None or boundary.active()) and o["anchor_every"] is None:
        o["anchor_every"] = max(n, 1)  # the initial carry only: the boundary check
    return Options(
        **o, reverse=reverse, unroll=unroll, xs=x_leaves, x_tree=x_tree, again=again
    )


def _scan_length(xs_leaves: list, length: int | None) -> int:
    """The number of steps, from the leading axes of ``xs`` and ``length``."""
    if any(np.ndim(x) == 0 for x in xs_leaves):
        raise ValueError(
            "scan got a scalar in xs; every leaf of xs needs a leading "
            "axis to scan over"
        )
    lengths = {int(np.shape(x)[0]) for x in xs_leaves}
    if length is not None:
        lengths.add(length)
    if len(lengths) > 1:
        raise ValueError(
            "scan got inconsistent lengths: the leading axes of xs and length give "
            f"{sorted(lengths)}"
        )
    if not lengths:
        raise ValueError("scan needs xs with a leading axis or an explicit length")
    return lengths.pop()
