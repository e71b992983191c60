"""The constructs a program is drawn from: one table, switched on and off by name.

The op generators live by family in :mod:`~tests.fuzz.constructs.basic`,
:mod:`~tests.fuzz.constructs.decisions` and :mod:`~tests.fuzz.constructs.loops`.
"""

import dataclasses
from collections.abc import Callable

from tests.fuzz.constructs import basic, decisions, loops
from tests.fuzz.families import ALL, FULL, HALF


@dataclasses.dataclass(frozen=True)
class Construct:
    """One kind of program element.

    Attributes:
      name: the construct's name (a row of the counts table).
      expect: ``"accept"`` or ``"refuse"`` (must raise ``NotInvertibleError``).
      families: the dtype families it can be drawn in.
      weight: how often it is drawn as an extra (non-featured) op.
      op: the op generator, or None for program-level constructs.
    """

    name: str
    expect: str
    families: tuple[str, ...]
    weight: float
    op: Callable | None = None


_C = Construct
CONSTRUCTS: dict[str, Construct] = {
    c.name: c
    for c in [
        _C("unary", "accept", ALL, 6.0, basic.unary),
        _C("coupling", "accept", ALL, 3.0, basic.coupling),
        _C("mix", "accept", ALL, 1.5, basic.mix),
        _C("halves", "accept", ALL, 1.5, basic.halves),
        _C("dot", "accept", FULL, 1.5, basic.dot),
        _C("custom_vjp", "accept", ALL, 1.0, basic.custom_vjp),
        _C("custom_jvp", "accept", FULL, 1.0, basic.custom_jvp),
        _C("nested_jit", "accept", FULL, 0.0, basic.nested_jit),
        _C("static_jit", "accept", ("f32", "f64"), 0.0, basic.static_jit),
        _C("zero_literal", "refuse", FULL, 0.0, basic.zero_literal),
        _C("narrowing_cast", "refuse", FULL, 0.0, basic.narrowing_cast),
        _C("batch_stats", "accept", FULL, 0.2, basic.batch_stats),
        _C("batch_norm_stream", "refuse", FULL, 0.0, basic.batch_norm_stream),
        _C("widening_cast", "accept", ("f32x64", *HALF), 0.3, basic.widening_cast),
        _C("dup_slices", "accept", ALL, 1.0, basic.dup_slices),
        _C("decision", "accept", FULL, 1.0, decisions.decision),
        _C("nested_decision", "accept", FULL, 0.0, decisions.nested_decision),
        _C("rem", "accept", FULL, 0.08, decisions.rem),
        _C("bucketing", "accept", FULL, 0.005, decisions.bucketing),
        _C("reduce_precision", "accept", FULL, 0.08, decisions.reduce_precision),
        _C("cast_round_trip", "accept", FULL, 0.08, decisions.cast_round_trip),
        _C("reduction_kink", "accept", FULL, 0.06, decisions.reduction_kink),
        _C("clamp_kink", "accept", FULL, 0.08, decisions.clamp_kink),
        _C("nan_guard", "accept", FULL, 0.0, decisions.nan_guard),
        _C(
            "revnet_scan_unused_ys",
            "accept",
            FULL,
            0.0,
            loops.scan_unused_ys("revnet.scan"),
        ),
        _C(
            "lax_scan_unused_ys",
            "accept",
            FULL,
            0.0,
            loops.scan_unused_ys("jax.lax.scan"),
        ),
        _C("nested_revnet_scan", "accept", FULL, 0.0, loops.nested_revnet_scan),
        _C("fori_loop", "accept", FULL, 0.0, loops.fori_loop),
        _C("half_dot", "accept", HALF, 1.5, basic.dot),
        _C("zero_batch", "accept", ("f32",), 0.0),
        _C("scan_wrapper", "accept", FULL, 0.0),
    ]
}
# How often each construct is the featured one (the rest are drawn as extras);
# the expensive ones (a compile per program) are drawn less often.
FEATURE_WEIGHTS = {
    "unary": 1.0,
    "coupling": 1.0,
    "mix": 0.5,
    "halves": 0.5,
    "dot": 0.8,
    "custom_vjp": 1.5,
    "custom_jvp": 1.2,
    "nested_jit": 0.5,
    "static_jit": 0.03,
    "zero_literal": 0.8,
    "narrowing_cast": 0.8,
    "batch_stats": 0.4,
    "batch_norm_stream": 0.4,
    "widening_cast": 0.4,
    "dup_slices": 1.2,
    "decision": 1.5,
    "nested_decision": 0.05,  # a loop, branch or checkpoint: compiles
    "rem": 0.12,
    "bucketing": 0.03,  # jnp.searchsorted's jitted call: compiles
    "reduce_precision": 0.1,
    "cast_round_trip": 0.1,
    "reduction_kink": 0.1,
    "clamp_kink": 0.1,
    "nan_guard": 0.1,
    "revnet_scan_unused_ys": 0.03,
    "lax_scan_unused_ys": 0.03,
    "nested_revnet_scan": 0.03,
    "fori_loop": 0.03,
    "half_dot": 0.9,
    "zero_batch": 0.2,
    "scan_wrapper": 0.03,
}
# Programs with any of these start from tied inputs
# (:func:`~tests.fuzz.programs.materialise`) and store kinks: a decision on a tie,
# or a kink whose derivative at a tie must be jax.grad's.
TIED = frozenset(
    [
        "decision",
        "nested_decision",
        "rem",
        "bucketing",
        "reduce_precision",
        "cast_round_trip",
        "reduction_kink",
        "clamp_kink",
        "nan_guard",
    ]
)
MIN_FEATURED = 5  # round-robin over the enabled constructs first, this many each
