"""Random-program fuzzer for ``revnet.invertible``, ``revnet.inverse``, ``revnet.scan``.

Each random program acts on two float streams ``a`` and ``b`` of shape
``(batch, d)`` and closes over a dict of weights. A program is generated as
Python *source* (one block of lines per operation) and built with ``exec``, so
the text printed for a failure is exactly the program that ran. Every program
is checked against plain JAX, eagerly (no ``jit`` per program: compiling would
dominate):

* the values of ``revnet.invertible(f)(a, b)`` equal ``f(a, b)``;
* the gradient of ``sum(sin(outputs))`` with respect to both inputs and every
  closed-over weight leaf equals plain ``jax.grad``, elementwise
  (:func:`tests.helpers.assert_trees_close`, rtol 1e-4 in float32, 1e-9 in
  float64, 2e-2 in half precision, where the results must also be as close to
  a float32 computation as plain JAX's);
* ``revnet.inverse(f, a, b)(f(a, b))`` rebuilds ``(a, b)``;
* constructs that lose information (a multiplication by a zero literal, a
  narrowing cast) are refused with ``NotInvertibleError`` at trace time;
* programs with a decision or a kink (:data:`TIED`: comparisons, ``rem``,
  bucketing, quantisation, reductions, clamps, and decisions inside a
  ``scan``, ``checkpoint``, ``cond`` or custom rule) start from *tied* inputs
  (halves: values exactly on thresholds, multiples and bucket edges), which a
  matrix product right after the decision makes the backward pass rebuild with
  rounding error; they run with ``kinks="store"``, and their gradients must
  still equal ``jax.grad``'s.

The plain reference runs the same source with ``jax.lax.scan``,
``jax.lax.fori_loop`` and ``revnet.scan`` as Python loops, ``jax.lax.cond`` and
``jax.lax.switch`` as selects, and ``jax.jit`` and ``jax.checkpoint`` as plain
calls: the same function, with nothing to compile.

Programs are drawn from *constructs*, each of which can be switched on or off
(:data:`CONSTRUCTS`). The run counts, per construct and in total, the programs
tried, accepted (not refused at trace time), refused (``NotInvertibleError`` at
trace time), those that raised anything else (``raised``) and those that were
``wrong``: a refused program that must be accepted, an accepted one that must be
refused, a mismatch, or an error (errors count as wrong too). A program counts
in the row of every construct it contains. Two kinds of draw are redrawn before
they are counted, and the run reports how many: programs whose plain forward
pass has huge intermediates, and programs with a numerical mismatch whose
inputs cannot be rebuilt at their precision at all (:func:`ill_conditioned`:
``(x / 2) ** 3`` twice, then ``+ tanh(...)``, loses ``x`` in float32).

Run it from the repository root::

    python -m tests.fuzz --programs 20000 --seed 1 --jobs 2
    python -m tests.fuzz --programs 500 --only custom_vjp,nested_jit
    python -m tests.fuzz --programs 500 --disable half_dot --verbose

It prints the counts table and, for each construct, the first failures with
their message and their (shrunk) source. The exit status is 1 when a program was
wrong.

The modules, in the order the data flows: :mod:`~tests.fuzz.gradients` (the
custom rules the programs call), :mod:`~tests.fuzz.families` (dtypes and
tolerances), :mod:`~tests.fuzz.constructs` (the table, and the op generators by
family), :mod:`~tests.fuzz.programs` (drawing, inputs, ``exec``),
:mod:`~tests.fuzz.plain` (the plain reference's loops and branches),
:mod:`~tests.fuzz.compare`, :mod:`~tests.fuzz.evaluate`, :mod:`~tests.fuzz.check`
and :mod:`~tests.fuzz.static` (checking one program), :mod:`~tests.fuzz.report`
(runs, counts, shrinking) and :mod:`~tests.fuzz.cli` (``python -m tests.fuzz``).
"""

from tests.fuzz.check import check_program, ill_conditioned
from tests.fuzz.cli import main
from tests.fuzz.compare import Redraw, Wrong, compare, compare_to_reference
from tests.fuzz.constructs import (
    CONSTRUCTS,
    FEATURE_WEIGHTS,
    MIN_FEATURED,
    TIED,
    Construct,
)
from tests.fuzz.families import ALL, FAMILIES, FULL, HALF
from tests.fuzz.programs import Op, Program, build, draw_program, materialise
from tests.fuzz.report import Failure, Report, run, shrink

__all__ = [
    "ALL",
    "CONSTRUCTS",
    "FAMILIES",
    "FEATURE_WEIGHTS",
    "FULL",
    "HALF",
    "MIN_FEATURED",
    "TIED",
    "Construct",
    "Failure",
    "Op",
    "Program",
    "Redraw",
    "Report",
    "Wrong",
    "build",
    "check_program",
    "compare",
    "compare_to_reference",
    "draw_program",
    "ill_conditioned",
    "main",
    "materialise",
    "run",
    "shrink",
]
