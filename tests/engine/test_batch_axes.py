"""revnet._engine.batching.axes: which values keep the batch's axes example by
example, read from the program (the proof behind a per-example
log-determinant)."""

import jax
import jax.numpy as jnp
from jax import lax

from revnet._engine.batching.axes import LEADING, MIXED, UNBATCHED, Tracker

X = jnp.ones((3, 4))
WS = jnp.ones((2, 4))


def out_flags(f, *args, flags=(LEADING,)):
    """The flags of ``f``'s outputs, its arguments flagged ``flags``."""
    jaxpr = jax.make_jaxpr(f)(*args).jaxpr
    return Tracker((3,)).run(jaxpr, list(flags))[1]


def _stack(x, ws):
    """A scan over layers: the carry per example, the ``ys`` stacked."""
    return lax.scan(lambda h, w: (h * w, h > 0), x, ws)


def test_a_scan_stacks_its_ys_behind_the_steps_axis():
    assert out_flags(_stack, X, WS, flags=(LEADING, UNBATCHED)) == [
        LEADING,
        LEADING + 1,
    ]


def test_a_scan_reads_stacked_xs_example_by_example():
    def f(x, ws):
        h, stored = _stack(x, ws)
        return lax.scan(lambda h, s: (jnp.where(s, h, 2.0 * h), None), h, stored)[0]

    assert out_flags(f, X, WS, flags=(LEADING, UNBATCHED)) == [LEADING]


def test_nested_scans_stack_twice():
    def f(x, ws):
        return lax.scan(lambda h, w: _stack(h, w), x, jnp.stack([ws, ws]))

    assert out_flags(f, X, WS, flags=(LEADING, UNBATCHED)) == [LEADING, LEADING + 2]


def test_any_other_equation_on_a_stacked_value_is_mixed():
    # Even elementwise: a solved value's terms are reduced over all but its
    # leading axes, which a stacked value does not lead with.
    for g in (lambda s: s * 2.0, lambda s: jnp.sum(s, 0), lambda s: s[0]):

        def f(x, ws, g=g):
            return g(lax.scan(lambda h, w: (h, h * w), x, ws)[1])

        assert out_flags(f, X, WS, flags=(LEADING, UNBATCHED)) == [MIXED]


def test_scanning_over_the_batch_axis_is_mixed():
    f = lambda x: lax.scan(lambda c, r: (c, 2.0 * r), 0.0, x)[1]  # noqa: E731
    assert out_flags(f, X) == [MIXED]


def test_the_ys_are_read_at_the_carrys_fixed_point():
    """The carry rises twice (unbatched, per example, then mixed by the sum
    over the batch): the ``ys`` read it at the fixed point, not before."""

    def f(x):
        def step(c, _):
            return x + jnp.sum(c, 0), c

        return lax.scan(step, jnp.zeros_like(x), None, length=3)

    assert out_flags(f, X) == [MIXED, MIXED]


def test_an_equation_without_inputs_is_unbatched():
    f = lambda x: x * lax.iota(x.dtype, 4)  # noqa: E731
    assert out_flags(f, X) == [LEADING]


def test_the_first_equation_on_a_stacked_value_is_named_with_why():
    def f(x, ws):
        return lax.scan(lambda h, w: (h, h * w), x, ws)[1] * 2.0

    jaxpr = jax.make_jaxpr(f)(X, WS).jaxpr
    eqn, why = Tracker((3,)).first_mixing(jaxpr, [LEADING, UNBATCHED], [0])
    assert eqn.primitive.name == "mul", eqn
    assert "a scan's outputs stacked over its steps" in why, why


def test_a_lookup_by_each_examples_indices_keeps_the_examples():
    """A spline's bucket lookup: a table read at indices computed per example
    (``knots[searchsorted(...)]``), or each example's own row read at its own
    indices (``take_along_axis``), and a comparison that broadcasts an axis
    of size 1 (``x[..., None] >= knots``)."""
    knots = jnp.linspace(-1.0, 1.0, 5)
    table = lambda x, k: k[jnp.searchsorted(k, x)]  # noqa: E731
    assert out_flags(table, X, knots, flags=(LEADING, UNBATCHED)) == [LEADING]
    count = lambda x, k: jnp.sum(x[..., None] >= k, -1)  # noqa: E731
    assert out_flags(count, X, knots, flags=(LEADING, UNBATCHED)) == [LEADING]
    rows = jnp.ones((3, 4, 5))
    idx = jnp.zeros((3, 4, 1), jnp.int32)
    own = lambda r, i: jnp.take_along_axis(r, i, axis=-1)  # noqa: E731
    assert out_flags(own, rows, idx, flags=(LEADING, LEADING)) == [LEADING]

    # But each example's indices reading another example's row mix them.
    other = lambda r, i: jnp.take_along_axis(r, i, axis=0)  # noqa: E731
    assert out_flags(other, rows, idx, flags=(LEADING, LEADING)) == [MIXED]
