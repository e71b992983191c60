"""Shared checks: compare an ``@invertible`` function with plain autodiff."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import revnet
from revnet._engine import jaxpr as jx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The one table of relative tolerances: by the kind of comparison, then by
# dtype name (the fuzzer's by program family). Look them up with ``tolerance``.
RTOL = {
    # One function against plain autodiff, measured against the largest value
    # of each compared tree. Half precision gets the fuzzer's margin below.
    "autodiff": {
        "float32": 1e-5,
        "float64": 1e-10,
        "float16": 2e-2,
        "bfloat16": 2e-2,
    },
    # Gradients carried back through tens of reconstructed steps (loop modes,
    # anchors, stacks): each inverted step adds float32 rounding to the carry
    # it rebuilds, so float32 gets twice the single-function tolerance.
    "loops": {"float32": 2e-5, "float64": 1e-10},
    # Sharded against single-device runs, elementwise and absolute: the
    # collectives sum in another order.
    "sharded": {"float32": 2e-5, "float64": 1e-12},
    # The decision cases' stacks and the decision programs
    # (benchmarks/decisions.py) at exact ties, per leaf (a flipped decision
    # is wrong by 5e-3 and more).
    "decision_cases": {"float32": 1e-3, "float64": 1e-8},
    # The peers' ported tests: oryx's and Equinox's (their own margins), and
    # JAX's invertible_ad prototype's.
    "ported": {"float32": 2e-5, "float64": 1e-11},
    "jax_invertible_ad": {"float32": 2e-6, "float64": 1e-12},
    # Log-determinants against slogdet(jacfwd(...)), a closed form or a
    # layer's hand-written one, elementwise.
    "log_det": {"float32": 1e-5, "float64": 1e-10},
    # The absolute term beside "log_det" (an atol, not an rtol): for
    # log-determinants that are zero or nearly so (additive and
    # volume-preserving layers), where a relative test would be of rounding.
    "log_det_floor": {"float32": 1e-6, "float64": 1e-12},
    # Values that only a few roundings separate: an invertible function's
    # forward values against the plain function's (the same operations), the
    # inverse of a map of one or two operations, a closed form's value, the
    # cotangent of a linear map, gradients through a user's rule for a map of
    # a few operations. The rtol, or the atol of a comparison with zeros.
    "values": {"float32": 1e-6, "float64": 1e-12},
    # A network's input rebuilt by its inverse against the input (the forward
    # pass then the inverse), elementwise, as the rtol and as the atol (for
    # inputs near zero).
    "round_trip": {"float32": 1e-5, "float64": 1e-10},
    # Random programs, by family (tests/fuzz/families.py).
    "fuzz": {"f32": 1e-4, "f32x64": 1e-4, "f64": 1e-9, "f16": 2e-2, "bf16": 2e-2},
}


def tolerance(dtype, kind: str = "autodiff", *, loops: bool = False) -> float:
    """The tolerance of ``dtype`` (a name, a scalar type such as ``jnp.float32``
    or a dtype object; for ``kind="fuzz"`` a family name) for comparisons of
    ``kind``; ``loops=True`` is ``kind="loops"``."""
    table = RTOL["loops" if loops else kind]
    return table[dtype if dtype in table else jnp.dtype(dtype).name]


def is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def cast_floats(tree, dtype):
    """``tree`` with its floating point leaves cast to ``dtype``."""

    def leaf(a):
        return a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a

    return jax.tree.map(leaf, tree)


def cotangents_like(tree, seed: int = 0):
    """Deterministic non-trivial cotangents (float0 zeros for integer leaves)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    out = []
    for n, leaf in enumerate(leaves):
        if is_float(leaf):
            k = jax.random.fold_in(jax.random.key(seed), n)
            out.append(jax.random.normal(k, np.shape(leaf), jnp.result_type(leaf)))
        else:
            out.append(np.zeros(np.shape(leaf), jax.dtypes.float0))
    return jax.tree_util.tree_unflatten(treedef, out)


def assert_trees_close(
    actual,
    expected,
    rtol: float,
    what: str = "value",
    floor: float = 0.1,
    exact_dtypes: bool = False,
):
    """Elementwise comparison of two trees, leaf by leaf.

    Each float leaf is compared with ``rtol`` relative to its own elements plus
    an absolute term ``rtol * max(leaf_max, floor * tree_max)``. The floor
    matters for leaves whose true value is zero in theory (a bias feeding a
    BatchNorm): they are rounding noise, so they are measured against a fraction
    of the tree's largest value instead of against themselves; ``floor=0``
    measures each leaf against itself only. With ``exact_dtypes`` every leaf
    must also have the expected dtype, and the non-float leaves must be equal.
    """
    assert jax.tree_util.tree_structure(actual) == jax.tree_util.tree_structure(
        expected
    ), f"{what}: tree structures differ"
    la = jax.tree_util.tree_leaves(actual)
    le = jax.tree_util.tree_leaves(expected)
    assert len(la) == len(le), f"{what}: {len(la)} leaves vs {len(le)}"
    if exact_dtypes:
        for n, (a, e) in enumerate(zip(la, le)):
            dts = (jnp.result_type(a), jnp.result_type(e))
            assert dts[0] == dts[1], f"{what} leaf {n}: dtype {dts[0]} vs {dts[1]}"
            if not is_float(e):
                np.testing.assert_array_equal(a, e, err_msg=f"{what} leaf {n}")
    floats = [(a, e) for a, e in zip(la, le) if is_float(e)]
    tree_max = max([_finite_max(e) for _, e in floats] + [0])
    assert tree_max > 0 or not floats, f"{what}: all zero, the check would be vacuous"
    for n, (a, e) in enumerate(floats):
        a = np.asarray(a, np.float64)
        e = np.asarray(e, np.float64)
        assert a.shape == e.shape, f"{what} leaf {n}: shape {a.shape} vs {e.shape}"
        if not a.size:
            continue
        # Non-finite expected values (a NaN gradient at a tie) must be
        # matched where they are, and leave the scale of the others alone.
        scale = max(_finite_max(e), floor * tree_max)
        np.testing.assert_allclose(
            a, e, rtol=rtol, atol=rtol * scale, err_msg=f"{what} leaf {n}"
        )


def _finite_max(x) -> float:
    """The largest magnitude among ``x``'s finite values (0 if none)."""
    x = np.abs(np.asarray(x, np.float64))
    x = x[np.isfinite(x)]
    return float(np.max(x)) if x.size else 0.0


def dtype_rtol(tree) -> float:
    """The loosest "autodiff" tolerance of ``tree``'s float leaves' dtypes."""
    dts = [jnp.result_type(x) for x in jax.tree_util.tree_leaves(tree) if is_float(x)]
    return max(tolerance(d) for d in dts) if dts else tolerance("float32")


def check_against_autodiff(fun, *args, rtol: float | None = None, seed: int = 0):
    """Checks values, the inverse and the VJP of ``invertible(fun)`` at ``args``.

    Compares the VJP with ``jax.vjp(fun)`` for every positional input. Closed-over
    constants are checked by the callers that own them.
    """
    rfun = revnet.invertible(fun)
    rtol = dtype_rtol(args) if rtol is None else rtol
    out, vjp = jax.vjp(fun, *args)
    rout, rvjp = jax.vjp(rfun, *args)
    assert_trees_close(rout, out, rtol, "output")
    cts = cotangents_like(out, seed)
    assert_trees_close(rvjp(cts), vjp(cts), rtol, "cotangent")
    back = revnet.inverse(fun, *args)(out)
    assert isinstance(back, tuple) and len(back) == len(args)
    assert_trees_close(back, args, rtol, "inverse")
    return out


def _flat(f, known, x):
    def g(v):
        outs = jax.tree_util.tree_leaves(f(*known, v.reshape(x.shape)))
        return jnp.concatenate([jnp.ravel(o) for o in outs])

    return g


def slogdet_reference(f, known, x, *, jac=jax.jacfwd):
    """``log|det|`` of the Jacobian of the flattened map ``x -> f(*known, x)``
    (``jac=jax.jacrev`` for a map with a ``custom_vjp`` inside)."""
    return jnp.linalg.slogdet(jac(_flat(f, known, x))(jnp.ravel(x)))[1]


def per_example_slogdet(f, known, x, *, jac=jax.jacfwd):
    """One :func:`slogdet_reference` per example: ``f``'s first output
    restricted to example ``b`` of a batch (``f`` maps ``[batch, ...]``)."""

    def one(xb):
        return slogdet_reference(
            lambda *a: f(*a[:-1], a[-1][None])[0], known, xb, jac=jac
        )

    return jnp.stack([one(x[b]) for b in range(x.shape[0])])


def batch_block_slogdet(f, x, *, jac=jax.jacfwd):
    """One ``log|det|`` per example of the Jacobian of the whole batch's map
    ``f`` (``[batch, ...] -> [batch, ...]``): its diagonal blocks, after
    checking that the others are zero (each example's output reads its own
    example alone). For maps that hold per-position state, such as dropout
    masks drawn for the whole batch, which a batch of one would not draw."""
    b = x.shape[0]
    full = jac(lambda v: f(v.reshape(x.shape)).reshape(b, -1))(x.reshape(b, -1))
    blocks = jnp.stack([full[i, :, i, :] for i in range(b)])
    off = full.at[jnp.arange(b), :, jnp.arange(b), :].set(0.0)
    np.testing.assert_array_equal(off, 0.0, err_msg="examples are mixed")
    return jnp.linalg.slogdet(blocks)[1]


def compiled(fn, *args):
    """Lowers and compiles ``jax.jit(fn)`` for ``args``."""
    return jax.jit(fn).lower(*args).compile()


def temp_size(program) -> int:
    """XLA's planned temporary (activation/workspace) memory of a compiled
    program, per device."""
    return program.memory_analysis().temp_size_in_bytes


def temp_bytes(fn, *args) -> int:
    """``temp_size`` of ``jit(fn)`` compiled for ``args``."""
    return temp_size(compiled(fn, *args))


def flop_count(program) -> float:
    """XLA's FLOP count of a compiled program (a loop body is counted once)."""
    return program.cost_analysis()["flops"]


def flops(fn, *args) -> float:
    """``flop_count`` of ``jit(fn)`` compiled for ``args``."""
    return flop_count(compiled(fn, *args))


# Forced CPU devices are threads: on a loaded 2-core machine a collective's
# participants can take longer than XLA:CPU's default 40 s to meet, and XLA
# then aborts the process. Subprocess tests give them 10 minutes.
COLLECTIVE_PATIENCE = (
    "--xla_cpu_collective_call_terminate_timeout_seconds=600 "
    "--xla_cpu_collective_call_warn_stuck_timeout_seconds=120"
)

# XLA:CPU runs each device's part of a program on a pool of max(cores,
# devices) threads, and a dispatch that waits for a free in-flight slot of its
# device (32 per device) blocks a pool thread. With 8 devices on 2 cores, the
# launches of the next program can hold threads that the running program's
# collective needs, and both wait forever (reproduced with plain JAX:
# tests/sharding/test_thread_pool.py). PJRT_NPROC sets the pool's size; twice
# the devices leaves one thread per participant after every blocked launch.
THREADS_PER_DEVICE = 2


def subprocess_env(devices: int | None = 8, **extra: str) -> dict[str, str]:
    """The environment of a subprocess that runs JAX on ``devices`` forced CPU
    devices (None: JAX's default, or what the program asks for with
    ``jax_num_cpu_devices``, at most 8): patient collectives, a thread pool
    that cannot deadlock, the repository on the path, and ``extra``."""
    env = dict(os.environ, XLA_FLAGS=COLLECTIVE_PATIENCE, **extra)
    if devices is not None:
        env["XLA_FLAGS"] += f" --xla_force_host_platform_device_count={devices}"
    env["PJRT_NPROC"] = str(THREADS_PER_DEVICE * (devices or 8))
    env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    return env


def run_python(
    *argv: str,
    devices: int | None = 8,
    timeout: float = 900,
    launcher: Sequence[str] = (),
) -> str:
    """Runs ``python *argv`` in a fresh interpreter at the repository root, with
    ``devices`` forced CPU devices (None: JAX's default), under ``launcher``
    (such as ``("taskset", "-c", "0")``); asserts that it exits 0 and returns
    its stdout. ``run_python("-c", code)`` runs a snippet."""
    proc = subprocess.run(
        [*launcher, sys.executable, *argv],
        cwd=ROOT,
        env=subprocess_env(devices),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


@contextlib.contextmanager
def runtime_checks(enabled: bool):
    """Sets revnet's run-time checks inside the block (cost tests measure the
    default, checks off); the suite's setting comes back afterwards."""
    revnet.set_runtime_checks(enabled)
    try:
        yield
    finally:
        revnet.set_runtime_checks(None)


@jax.custom_jvp
def nondifferentiable(x):
    """As Equinox's ``nondifferentiable``: raises on a tangent that is not a
    symbolic zero."""
    return x


def _nondifferentiable_jvp(primals, tangents):
    if type(tangents[0]) is not jax.custom_derivatives.SymbolicZero:
        raise RuntimeError("Unexpected tangent: this value must not be differentiated")
    return primals[0], tangents[0]


nondifferentiable.defjvp(_nondifferentiable_jvp, symbolic_zeros=True)


# JAX's opt-in custom_vjp3 (JAX_CUSTOM_VJP3=1, jax 0.10.2) raises its own
# NotImplementedError for forward mode on a custom_vjp with symbolic zeros,
# before revnet can say so in one line; and it refuses a custom_vjp closing over
# a tracer before revnet sees the function.
UNDER_CUSTOM_VJP3 = bool(jax.config.jax_custom_vjp3)
UNDER_SCAN3 = bool(jax.config.jax_scan3)


def equations(fun, *args) -> list:
    """The equations of ``fun``'s jaxpr, nested jaxprs included, in order; a
    hijax call is followed by the equations of its expansion."""
    return equations_of(jax.make_jaxpr(fun)(*args).jaxpr)


def equations_of(jaxpr) -> list:
    """The equations of ``jaxpr``, nested jaxprs included (as :func:`equations`)."""
    found: list = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            found.append(e)
            if e.primitive.name == jx.HI_CALL:
                body = jx.call_body(e)
                if body is not None:
                    walk(body.jaxpr)
            for p in e.params.values():
                inner = jx.nested_jaxpr(p)
                if inner is not None:
                    walk(inner[0])

    walk(jaxpr)
    return found


def primitives(fun, *args) -> set[str]:
    """Names of the primitives in ``fun``'s jaxpr, nested jaxprs included; a
    hijax call is also named with its class (``call_hi_primitive[Scan3]``) and
    seen through to its expansion."""
    names: set[str] = set()
    for e in equations(fun, *args):
        names.add(e.primitive.name)
        if e.primitive.name == jx.HI_CALL:
            names.add(f"{jx.HI_CALL}[{jx.hi_kind(e)}]")
    return names


def load_example(name: str, module_name: str | None = None):
    """The module ``examples/<name>.py``, loaded from its file (the examples
    are standalone scripts, not a package)."""
    path = os.path.join(ROOT, "examples", f"{name}.py")
    spec = importlib.util.spec_from_file_location(module_name or name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def boundary_check(mode):
    """The boundary check set to ``mode`` inside the block, then the default."""
    revnet.set_boundary_check(mode)
    try:
        yield
    finally:
        revnet.set_boundary_check("warn")


@contextlib.contextmanager
def calls_of(*fns):
    """The calls of the Python functions ``fns`` made inside the block (the
    caller's name for each), seen by a profiler (``sys.setprofile``): nothing
    is patched."""
    codes, calls, before = {fn.__code__ for fn in fns}, [], sys.getprofile()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            calls.append(frame.f_back.f_code.co_name)

    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(before)
