"""Test runs under JAX's opt-in "next primitive" flags (``make test-next``).

``JAX_CUSTOM_VJP3``, ``JAX_REMAT3`` and ``JAX_SCAN3`` reroute ``jax.custom_vjp``,
``jax.checkpoint`` and ``lax.scan`` to JAX's hijax implementations, and some
programs then fail in plain JAX itself: jax 0.10.2's ``Scan3`` has no reverse
mode ("must implement `vjp_fwd`"), so ``jax.grad`` of any function with a
``lax.scan`` fails. A test whose reference computation is such a program cannot
compare revnet with JAX; under a flag it is reported as skipped, with JAX's own
message as the reason, when (and only when) its failure was raised inside JAX
with no revnet frame anywhere on the stack: plain JAX, run by the test, failed.
Any other failure (an assertion, an error raised through revnet) stays a
failure.
"""

from __future__ import annotations

import os
import types

import jax
import pytest

import revnet

FLAGS = ("JAX_CUSTOM_VJP3", "JAX_REMAT3", "JAX_SCAN3")
_JAX_DIR = os.path.dirname(jax.__file__) + os.sep
_REVNET_DIR = os.path.dirname(revnet.__file__) + os.sep


def flags_on() -> list[str]:
    """The next-primitive flags set in the environment."""
    return [f for f in FLAGS if os.environ.get(f, "").lower() in ("1", "true")]


if flags_on():
    # JAX's frames stay in tracebacks, so that a failure inside JAX is told
    # from one raised through revnet.
    jax.config.update("jax_traceback_filtering", "off")


def _frames(tb: types.TracebackType | None) -> list[str]:
    files = []
    while tb is not None:
        files.append(os.path.abspath(tb.tb_frame.f_code.co_filename))
        tb = tb.tb_next
    return files


def _all_frames(exc: BaseException) -> list[str]:
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
    """JAX's message when ``exc`` was raised inside JAX with no revnet frame."""
    if isinstance(exc, AssertionError):
        return None
    files = _all_frames(exc)
    if not files or any(f.startswith(_REVNET_DIR) for f in files):
        return None
    if not files[-1].startswith(_JAX_DIR):
        return None
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}"


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
        f"Skipped: plain JAX fails under {'+'.join(on)}: {reason}",
    )
