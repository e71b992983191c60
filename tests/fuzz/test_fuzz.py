"""Random-program fuzzing of invertible, inverse and scan (tests/fuzz/).

``make test-all`` runs 500 random programs and 500 programs with decisions
(``pytest -s`` prints their counts tables); ``make fuzz`` runs 20,000.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

import revnet
from tests import fuzz as fz
from tests.fuzz import log_dets
from tests.helpers import tolerance

pytestmark = pytest.mark.slow  # thousands of random programs

SHARDS = 1  # CI's time: make fuzz draws far more
PROGRAMS_PER_SHARD = 500
# The expensive constructs (compilations per program: loops, the jitted step)
# are drawn once per shard; every construct must appear at least MIN_DRAWS times
# per shard (counting the programs where it is one op among others).
RARE = {
    "static_jit",
    "revnet_scan_unused_ys",
    "lax_scan_unused_ys",
    "nested_revnet_scan",
    "fori_loop",
    "scan_wrapper",
}
# A decision in a loop, a branch or a checkpoint, and jnp.searchsorted's jitted
# call, compile per program (1 to 2 s each): drawn a few times per shard. The
# other constructs of fz.TIED are drawn more often by the decision shards below.
COSTLY = {"nested_decision", "bucketing"}
MIN_DRAWS = {name: 1 if name in RARE else 10 for name in fz.CONSTRUCTS}
MIN_DRAWS.update(zero_batch=3, widening_cast=5)
MIN_DRAWS.update({name: 1 if name in COSTLY else 3 for name in fz.TIED - {"decision"}})


@pytest.mark.parametrize("shard", range(SHARDS))
def test_random_programs(shard):
    report = fz.run(
        PROGRAMS_PER_SHARD,
        seed=1000 + shard,
        min_featured=1,  # the rare constructs: once per shard, not at random
        feature_weights={name: 0.0 for name in RARE},
    )
    print(f"\nshard {shard} of {SHARDS}:\n{report.table()}")
    assert report.total["tried"] == PROGRAMS_PER_SHARD
    drawn = {name: report.counts[name]["tried"] for name in fz.CONSTRUCTS}
    rare = {name: n for name, n in drawn.items() if n < MIN_DRAWS[name]}
    assert not rare, f"constructs drawn too rarely: {rare}"
    assert report.total["wrong"] == 0, "\n" + report.failures_text(per_construct=1)


def _scaled_gradients(fun):
    """A broken ``invertible``: right values, gradients 1% too large."""

    @jax.custom_vjp
    def scale(x):
        return x

    scale.defvjp(lambda x: (x, None), lambda _, g: (g * 1.01,))

    def wrapped(*args):
        return fun(*jax.tree_util.tree_map(scale, args))

    return wrapped


def test_checker_catches_wrong_gradients():
    report = fz.run(12, seed=3, only=["coupling", "dot"], invertible=_scaled_gradients)
    assert report.total["wrong"] == report.total["tried"] == 12, report.table()


def test_checker_catches_accepted_information_loss():
    report = fz.run(12, seed=3, only=["zero_literal", "narrowing_cast"])
    refused = report.total["refused"]
    assert report.total["wrong"] == 12 - refused, report.table()
    accept_all = fz.run(
        12, seed=3, only=["zero_literal", "narrowing_cast"], invertible=lambda f: f
    )
    assert accept_all.total["wrong"] == 12, accept_all.table()


def test_constructs_can_be_switched_on_and_off():
    report = fz.run(24, seed=5, only=["unary", "dup_slices", "custom_jvp"])
    assert set(report.counts) == {"unary", "dup_slices", "custom_jvp", "all"}
    report = fz.run(24, seed=5, disable=[n for n in fz.CONSTRUCTS if n != "unary"])
    assert set(report.counts) == {"unary", "all"}
    with pytest.raises(ValueError, match="unknown constructs"):
        fz.run(1, only=["no_such_construct"])


def test_refused_constructs_are_refused_at_trace_time():
    for name in ("zero_literal", "narrowing_cast"):
        for index in range(4):
            prog = fz.draw_program(7, index, [name, "unary"], featured=name)
            f, holder = fz.build(prog)
            with jax.enable_x64(fz.FAMILIES[prog.family][1]):
                ws, a, b = fz.materialise(prog)
                holder["ws"] = ws
                with pytest.raises(revnet.NotInvertibleError):
                    jax.eval_shape(revnet.invertible(f), a, b)


def test_plain_reference_runs_loops_as_python_loops():
    prog = fz.draw_program(2, 0, ["fori_loop"], featured="fori_loop")
    with jax.enable_x64(fz.FAMILIES[prog.family][1]):
        ws, a, b = fz.materialise(prog)
        f_plain, h_plain = fz.build(prog, plain=True)
        f_jax, h_jax = fz.build(prog)
        h_plain["ws"] = h_jax["ws"] = ws
        want = jax.tree_util.tree_map(jnp.asarray, f_plain(a, b))
        got = f_jax(a, b)
    fz.compare(got, want, tolerance(prog.family, "fuzz"), "values")


DECISION_SHARDS = 1  # CI's time: make fuzz draws far more
# Every program features a decision or a kink (fz.TIED) on tied inputs, with
# cheap constructs around it. How often each is featured:
DECISION_WEIGHTS = {
    "decision": 1.0,
    "rem": 0.12,
    "reduce_precision": 0.08,
    "cast_round_trip": 0.08,
    "reduction_kink": 0.06,
    "clamp_kink": 0.08,
    "nan_guard": 0.08,
    "nested_decision": 0.01,  # these compile per program (COSTLY)
    "bucketing": 0.005,
}
DECISION_POOL = [*DECISION_WEIGHTS, "unary", "coupling", "mix", "halves", "dot"]
DECISION_POOL.append("dup_slices")
MIN_FEATURED = {name: 0 if name in COSTLY else 10 for name in DECISION_WEIGHTS}
MIN_FEATURED["nested_decision"] = 1


@pytest.mark.parametrize("shard", range(DECISION_SHARDS))
def test_random_programs_with_decisions(shard):
    """1,000 programs, each with a decision or a stored kink in F on exact ties."""
    assert set(DECISION_WEIGHTS) == fz.TIED
    weights = {name: 0.0 for name in fz.CONSTRUCTS}
    weights.update(DECISION_WEIGHTS)
    report = fz.run(
        PROGRAMS_PER_SHARD,
        seed=3000 + shard,
        only=DECISION_POOL,
        min_featured=0,
        feature_weights=weights,
    )
    print(f"\ndecision shard {shard} of {DECISION_SHARDS}:\n{report.table()}")
    assert report.total["tried"] == PROGRAMS_PER_SHARD
    featured = {name: report.featured(name) for name in DECISION_WEIGHTS}
    assert sum(featured.values()) == PROGRAMS_PER_SHARD
    rare = {name: n for name, n in featured.items() if n < MIN_FEATURED[name]}
    assert not rare, f"constructs featured too rarely: {rare}"
    assert report.total["wrong"] == 0, "\n" + report.failures_text(per_construct=1)


# How each construct of fz.TIED is made wrong: decisions made again on rebuilt
# values, or kinks differentiated at rebuilt values. Among the first
# RECOMPUTED_PROGRAMS programs (seed 9) of each, at least one must then be
# wrong: the ties do flip, so every construct can fail.
RECOMPUTED = {
    "decision": "decisions",
    "nested_decision": "decisions",
    "rem": "decisions",
    "bucketing": "decisions",
    "reduce_precision": "decisions",
    "cast_round_trip": "decisions",
    "reduction_kink": "kinks",
    "clamp_kink": "kinks",
    "nan_guard": "decisions",
}
RECOMPUTED_PROGRAMS = 8


@pytest.mark.parametrize("name", sorted(RECOMPUTED))
def test_ties_catch_recomputed_decisions_and_kinks(name):
    """Decisions made again (kinks differentiated) on rebuilt values are caught."""
    option = RECOMPUTED[name]
    weights = {n: 0.0 for n in fz.CONSTRUCTS}
    weights[name] = 1.0
    report = fz.run(
        RECOMPUTED_PROGRAMS,
        seed=9,
        only=DECISION_POOL,
        shrink_failures=0,
        invertible=functools.partial(revnet.invertible, **{option: "recompute"}),
        min_featured=0,
        feature_weights=weights,
    )
    assert report.total["wrong"] >= 1, report.table()


# Random flows against slogdet(jacfwd): 2,000 in two shards here; make fuzz
# checks 10,000 (FUZZ_LOG_DETS).
LOG_DET_SHARDS = 2
LOG_DET_PROGRAMS = 1000


@pytest.mark.parametrize("shard", range(LOG_DET_SHARDS))
def test_random_log_dets(shard):
    counts, failures = log_dets.run(LOG_DET_PROGRAMS, seed=3 + shard)
    print(f"\nlog-det shard {shard}:\n" + log_dets.table(counts))
    assert counts["wrong"] == 0, "\n".join(failures[:5])
    assert counts["ok"] + counts["refused"] + counts["skipped"] == LOG_DET_PROGRAMS
    # Chains of cubes and sinh overflow, or drive a layer where its Jacobian's
    # reference is inexact (log_dets.RELIABLE): not counted.
    assert counts["skipped"] <= LOG_DET_PROGRAMS // 10, counts["skipped"]
    rare = [n for n in log_dets.LAYERS if counts[n, "ok"] < 20]
    assert not rare, f"layers checked too rarely: {rare}"


def test_log_det_checker_catches_a_wrong_log_det():
    """A log-determinant off by 1e-6 (relative 1e-7 or so) is caught."""

    def off(*args, **kw):
        y, ld = revnet.forward_and_log_det(*args, **kw)
        return y, ld + 1e-6

    counts, failures = log_dets.run(10, seed=9, log_det=off)
    assert counts["ok"] == 0 and counts["wrong"] > 0, counts
    assert all("slogdet(jacfwd)" in f for f in failures), failures


@pytest.mark.parametrize("index", [2642, 107146])
def test_programs_once_refused_are_accepted(index):
    """Programs of ``make fuzz`` (seed 1) that recomputing a small
    contraction (a product over 4 terms) from stored decisions' copies left
    unsolvable: contractions are stored, and these invert."""
    prog = fz.draw_program(1, index, list(fz.CONSTRUCTS))
    outcome, message = fz.check_program(prog)
    assert outcome == "accepted", message
