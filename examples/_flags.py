"""Command-line flags that fail fast, shared by the examples and the benchmarks.

A bad flag ends the program before any work, with exit status 2 and one line
on stderr, ``PROG: error: MESSAGE``: :class:`ArgumentParser` is argparse's
parser without the usage lines, and the types below refuse a count that is not
positive, a learning rate that is not a finite positive number, and an output
folder that cannot be written (it is created and a temporary file is written
in it and removed, before any training). :func:`fail` ends a program that
failed later (say, while saving) the same way, with exit status 1.

This module imports nothing but the standard library, so a script can parse
its flags before it imports JAX. The benchmarks load it by path
(``benchmarks/measure.py``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from typing import NoReturn


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line: ``PROG: error: MESSAGE``."""

    def error(self, message: str) -> NoReturn:
        """Prints the one line and exits with status 2."""
        self.exit(2, f"{self.prog}: error: {_line(message)} (see --help)\n")


def _line(text: object) -> str:
    """``text`` on one line."""
    return " ".join(str(text).split())


def positive_int(text: str) -> int:
    """An integer > 0 (epochs, steps, batch, depth, width)."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0 (a seed)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return value


def finite_positive_float(text: str) -> float:
    """A finite number > 0 (a learning rate)."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite positive number")
    return value


def writable_dir(text: str) -> str:
    """A folder that exists or can be created, and that a file can be written in.

    The folder is created (with its parents), a temporary file is written in it
    and removed; ``text`` is returned unchanged.
    """
    try:
        os.makedirs(text, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=text, prefix=".write-test-")
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
            os.remove(probe)
    except OSError as err:
        why = err.strerror or type(err).__name__
        raise argparse.ArgumentTypeError(f"cannot write in {text!r}: {why}") from None
    return text


def at_most(parser, flag: str, value: int, limit: int, what: str) -> None:
    """Refuses ``value`` (the flag ``flag``) above ``limit`` ``what``."""
    if value > limit:
        parser.error(f"argument {flag}: {value} is more than the {limit} {what}")


def fail(message: object, prog: str | None = None) -> NoReturn:
    """Ends the program with ``PROG: error: MESSAGE`` (one line), status 1."""
    prog = prog or os.path.basename(sys.argv[0])
    sys.exit(f"{prog}: error: {_line(message)}")
