"""Test runs under JAX's opt-in "next primitive" flags (``make test-next``).

``JAX_CUSTOM_VJP3``, ``JAX_REMAT3`` and ``JAX_SCAN3`` reroute ``jax.custom_vjp``,
``jax.checkpoint`` and ``lax.scan`` to JAX's hijax implementations, and some
programs then fail in plain JAX itself: jax 0.10.2's ``Scan3`` has no reverse
mode ("must implement `vjp_fwd`"), so ``jax.grad`` of any function with a
``lax.scan`` fails. A test whose reference computation is such a program cannot
compare revnet with JAX; under a flag it is reported as skipped, with JAX's own
message as the reason, when (and only when) its failure was raised inside JAX
with no frame of revnet's inversion machinery on the stack: plain JAX, run by
the test, failed. Any other failure (a test's assertion, an error raised
through revnet, a plain JAX result that differs) stays a failure.
"""

from __future__ import annotations

import os
import types

import jax
import numpy as np
import pytest

import revnet

FLAGS = ("JAX_CUSTOM_VJP3", "JAX_REMAT3", "JAX_SCAN3")
_JAX_DIR = os.path.dirname(jax.__file__) + os.sep
_REVNET_DIR = os.path.dirname(revnet.__file__) + os.sep
# The front doors and the framework-free stack under them: with
# ``reversible=False`` they run a plain network (a ``lax.scan`` over the
# layers), so their frames alone do not make a failure revnet's.
_FRONT_DOORS = tuple(
    os.path.join(_REVNET_DIR, name) + os.sep for name in ("blocks", "nnx", "eqx")
) + tuple(
    os.path.join(_REVNET_DIR, "_layers", name)
    for name in ("stack.py", "couplings.py", "checks.py")
)


def flags_on() -> list[str]:
    """The next-primitive flags set in the environment."""
    return [f for f in FLAGS if os.environ.get(f, "").lower() in ("1", "true")]


if flags_on():
    # JAX's frames stay in tracebacks, so that a failure inside JAX is told
    # from one raised through revnet.
    jax.config.update("jax_traceback_filtering", "off")


def _frames(tb: types.TracebackType | None) -> list[tuple[str, int]]:
    frames = []
    while tb is not None:
        frames.append((os.path.abspath(tb.tb_frame.f_code.co_filename), tb.tb_lineno))
        tb = tb.tb_next
    return frames


def _all_frames(exc: BaseException) -> list[tuple[str, int]]:
    """The files of ``exc``'s traceback, JAX's removed frames included.

    JAX filters its own frames out of a traceback and keeps the full one on
    an ``UnfilteredStackTrace`` in the exception's cause chain.
    """
    files = _frames(exc.__traceback__)
    seen = {id(exc)}
    inner = exc.__cause__ or exc.__context__
    while inner is not None and id(inner) not in seen:
        seen.add(id(inner))
        if type(inner).__name__ == "UnfilteredStackTrace":
            files = _frames(inner.__traceback__) or files
        inner = inner.__cause__ or inner.__context__
    return files


def plain_jax_failure(exc: BaseException) -> str | None:
    """JAX's message when ``exc`` was raised inside JAX by plain JAX code.

    That is: the innermost frame is JAX's, and no frame on the stack belongs to
    revnet's inversion machinery (any revnet module outside the front doors
    and their framework-free stack, ``_FRONT_DOORS``: those run as plain
    networks when they are the reference twin, ``reversible=False``, and call
    revnet's machinery otherwise, which then appears on the stack).
    """
    frames = _all_frames(exc)
    if not frames or not frames[-1][0].startswith(_JAX_DIR):
        return None
    if any(
        f.startswith(_REVNET_DIR) and not f.startswith(_FRONT_DOORS) for f, _ in frames
    ):
        return None
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    where = f"{os.path.relpath(frames[-1][0], _JAX_DIR)}:{frames[-1][1]}"
    return f"{type(exc).__name__} in jax/{where}: {first}".rstrip(": ")


def reverse_scan_is_wrong() -> bool:
    """Whether plain ``lax.scan(reverse=True)`` runs forwards (jax 0.10.2's Scan3
    ignores ``reverse``), found by running it against a Python loop."""
    xs = np.arange(3.0)
    _, ys = jax.lax.scan(
        lambda c, x: (c + x, c), 0.0, jax.numpy.asarray(xs), reverse=True
    )
    want, c = [], 0.0
    for x in xs[::-1]:
        want.append(c)
        c += x
    return not np.allclose(np.asarray(ys), want[::-1])


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "lax_reverse_scan_reference: compares with plain lax.scan(reverse=True); "
        "skipped where that runs forwards (plain JAX under JAX_SCAN3)",
    )


def pytest_runtest_setup(item):
    if item.get_closest_marker("lax_reverse_scan_reference") and flags_on():
        if reverse_scan_is_wrong():
            pytest.skip(
                f"plain JAX {jax.__version__} is wrong under {'+'.join(flags_on())}: "
                "lax.scan(reverse=True) runs forwards (Scan3 ignores reverse)"
            )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    on = flags_on()
    if not on or call.when != "call" or not report.failed or call.excinfo is None:
        return
    reason = plain_jax_failure(call.excinfo.value)
    if reason is None:
        return
    path, line, _ = item.reportinfo()
    report.outcome = "skipped"
    report.longrepr = (
        str(path),
        (line or 0) + 1,
        f"Skipped: plain JAX {jax.__version__} fails under {'+'.join(on)}: {reason}",
    )
