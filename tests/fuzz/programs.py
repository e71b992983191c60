"""Programs: ops drawn from the constructs, their inputs and weights, built with
``exec`` into ``f(a, b)`` (or into its plain reference).
"""

import dataclasses
import functools
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np

import revnet
from tests.fuzz import gradients
from tests.fuzz.constructs import CONSTRUCTS, FEATURE_WEIGHTS, TIED, basic
from tests.fuzz.constructs.generator import Gen
from tests.fuzz.families import FAMILIES, FAMILY_WEIGHTS, FULL, HALF
from tests.fuzz.plain import PLAIN_JAX, PLAIN_REVNET, py_scan


@dataclasses.dataclass
class Op:
    """One op of a program: its construct, variant and source lines."""

    construct: str
    variant: str
    lines: list[str]
    weights: dict[str, tuple[tuple[int, ...], str]]
    streams: tuple[str, str] = ("a", "b")  # the stream updated, the one read


@dataclasses.dataclass
class Program:
    """A random program and everything needed to check it.

    Attributes:
      seed: the run's seed; ``(seed, index)`` identifies the program.
      index: the program's index in the run.
      family: dtype family (a key of :data:`FAMILIES`).
      batch: batch size of the streams (0 for ``zero_batch``).
      d: width of the streams.
      mode: ``"invertible"``, ``"scan"`` (body of a ``revnet.scan``) or
        ``"static"`` (the ``static_jit`` construct).
      ops: the operations, in order.
      featured: the construct this program was drawn for.
      scan_length: steps of the ``scan`` mode.
    """

    seed: int
    index: int
    family: str
    batch: int
    d: int
    mode: str
    ops: list[Op]
    featured: str
    scan_length: int = 0

    @property
    def constructs(self) -> set[str]:
        out = {op.construct for op in self.ops}
        if self.batch == 0:
            out.add("zero_batch")
        if self.mode == "scan":
            out.add("scan_wrapper")
        return out

    @property
    def expect(self) -> str:
        refuse = any(CONSTRUCTS[op.construct].expect == "refuse" for op in self.ops)
        return "refuse" if refuse else "accept"

    @property
    def rounds(self) -> int:
        return 2 if "nested_jit" in self.constructs else 1

    @property
    def weights(self) -> dict[str, tuple[tuple[int, ...], str]]:
        out = {}
        for op in self.ops:
            out.update(op.weights)
        if self.mode == "scan":
            out["xs"] = ((self.scan_length, self.d), "normal")
        return out

    def source(self, scan: str = "SCAN", probe: bool = False) -> str:
        """The program as the source of ``def f(a, b)``."""
        body = []
        for op in self.ops:
            body += op.lines
            if probe:  # eager: a scan's body runs in a Python loop when probed
                body.append("PROBE(a, b)")
        if self.mode == "scan":
            inner = ["a, b = c", "a = a + t", *body, "return (a, b), jnp.sum(a)"]
            body = [
                "def body(c, t):",
                *("    " + line for line in inner),
                f'(a, b), ys = {scan}(body, (a, b), w["xs"])',
            ]
            if probe:
                body.append("PROBE(a, b, ys)")
            ret = "return a, b, ys"
        else:
            ret = "return a, b"
        lines = ["def f(a, b):", '    w = holder["ws"]']
        lines += ["    " + line for line in [*body, ret]]
        return "\n".join(lines)

    def describe(self) -> str:
        ops = ", ".join(f"{op.construct}:{op.variant}" for op in self.ops)
        return (
            f"program seed={self.seed} index={self.index} family={self.family} "
            f"batch={self.batch} mode={self.mode} ops=[{ops}]"
        )


def _draw_ops(g: Gen, featured: str | None, n_ops: int, names: list[str]) -> list[Op]:
    pool = [n for n in names if CONSTRUCTS[n].op and CONSTRUCTS[n].weight > 0]
    pool = [n for n in pool if g.family in CONSTRUCTS[n].families]
    if g.family in HALF:
        pool = [n for n in pool if n != "dot"]
    if featured is not None and CONSTRUCTS[featured].expect == "refuse":
        pool = [n for n in pool if n != "widening_cast"]
    if not pool:  # only constructs that are never extras are enabled
        pool, n_ops = [featured or "coupling"], 1
    p = np.array([CONSTRUCTS[n].weight for n in pool]) + 1e-9
    plan = [pool[i] for i in g.rng.choice(len(pool), n_ops, p=p / p.sum())]
    follow = False  # a dot follows the first op, on the stream it read
    if featured is not None:
        # A decision early in the program reads the quantised inputs' ties. A
        # matrix product then changing the stream it read makes the backward
        # pass rebuild that stream by a solve, with rounding error (an additive
        # coupling mostly gives a half back exactly): a tie made again there
        # flips half of the time.
        first = featured in TIED and g.rng.uniform() < 0.8
        plan[0 if first else int(g.rng.integers(n_ops))] = featured
        if first and "dot" in names and g.rng.uniform() < 0.8:
            plan[1:2] = ["dot"]  # in place of the second op, or appended
            follow = True
    if g.family in HALF and "half_dot" in names and "half_dot" not in plan:
        plan.insert(int(g.rng.integers(n_ops + 1)), "half_dot")
    loops = {"revnet_scan_unused_ys", "lax_scan_unused_ys", "nested_revnet_scan"}
    loops |= {"fori_loop", "nested_decision"}
    if loops & set(plan):  # a loop's carry keeps its dtype
        plan = ["unary" if n == "widening_cast" else n for n in plan]
    widened = False
    g.tied = bool(TIED & set(plan))
    ops = []
    for n, name in enumerate(plan):
        if name == "widening_cast" and widened:
            name = "unary"
        x, y = ("a", "b") if g.rng.integers(2) == 0 else ("b", "a")
        if follow and n == 1:
            x, y = ops[0].streams[::-1]
        g.n = n
        before = dict(g.weights)
        variant, lines = CONSTRUCTS[name].op(g, x, y)
        widened |= name == "widening_cast"
        new = {k: v for k, v in g.weights.items() if k not in before}
        ops.append(Op(name, variant, lines, new, (x, y)))
    return ops


def draw_program(
    seed: int,
    index: int,
    enabled: Iterable[str],
    featured: str | None = None,
    weights: dict[str, float] | None = None,
) -> Program:
    """Draws program ``index`` of the run ``seed`` from the enabled constructs.

    Args:
      seed: the run's seed.
      index: the program's index.
      enabled: names of the constructs that may appear.
      featured: the construct the program is drawn for; None draws one.
      weights: how often each construct is featured, instead of
        :data:`FEATURE_WEIGHTS` (for those it names).

    Returns:
      The program.
    """
    names = [n for n in CONSTRUCTS if n in set(enabled)]
    rng = np.random.default_rng([seed, index])
    if featured is None:
        weights = {**FEATURE_WEIGHTS, **(weights or {})}
        w = np.array([weights[n] for n in names]) + 1e-12
        featured = names[int(rng.choice(len(names), p=w / w.sum()))]
    # Half-precision programs are drawn for half_dot (and widening casts from
    # half precision, which need a half_dot in the program to be drawn).
    # Each dtype (and float32 under x64) compiles every eager primitive anew, so
    # float32 under x64 is drawn for widening casts only, and zero-size batches
    # (float32 only) with few kinds of op.
    families = [f for f in CONSTRUCTS[featured].families if f in ("f32", "f64")]
    if featured == "widening_cast":
        families = ["f32x64"]
    if featured == "half_dot" or (featured == "widening_cast" and "half_dot" in names):
        families = list(CONSTRUCTS[featured].families)
    if featured == "zero_batch":
        names = [n for n in names if n in ("unary", "coupling", "dot")]
    fw = np.array([FAMILY_WEIGHTS[f] for f in families])
    family = families[int(rng.choice(len(families), p=fw / fw.sum()))]
    mode = {"static_jit": "static", "scan_wrapper": "scan"}.get(featured, "invertible")
    # Few distinct shapes: eager execution compiles each primitive per shape.
    batch = 0 if featured == "zero_batch" else 2
    d = 4
    g = Gen(rng, family, d, batch)
    short = mode != "invertible" or family in HALF or batch == 0
    max_ops = 3 if short else 6
    n_ops = int(rng.integers(1, max_ops + 1))
    op_featured = featured if CONSTRUCTS[featured].op else None
    if mode == "scan":
        names = [n for n in names if CONSTRUCTS[n].weight > 0]
    ops = _draw_ops(g, op_featured, n_ops, names)
    if batch == 0 and not any(o.construct in ("coupling", "dot") for o in ops):
        g.n = len(ops)
        before = dict(g.weights)
        variant, lines = basic.dot(g, "a", "b")
        new = {k: v for k, v in g.weights.items() if k not in before}
        ops.append(Op("dot" if family in FULL else "half_dot", variant, lines, new))
    length = int(rng.integers(1, 4)) if mode == "scan" else 0
    return Program(seed, index, family, batch, d, mode, ops, featured, length)


def materialise(prog: Program, round_: int = 0, ties: bool | None = None):
    """The weights dict and the inputs ``(a, b)`` of a program (one round).

    Each leaf is drawn from its own seed, so that removing an op while shrinking
    leaves the other values unchanged. The inputs are tied (quantised) when
    ``ties`` is true, or, by default, when the program has a construct of
    :data:`TIED`.
    """
    dtype = FAMILIES[prog.family][0]
    ws = {}
    for n, (name, (shape, kind)) in enumerate(sorted(prog.weights.items())):
        r = np.random.default_rng([prog.seed, prog.index, round_, 7, n])
        if kind == "positive":
            v = (0.5 + r.uniform(size=shape)) * np.where(
                r.uniform(size=shape) < 0.5, -1, 1
            )
        elif kind == "eye":
            v = np.eye(shape[-1]) + 0.1 * r.standard_normal(shape)
        else:
            v = 0.4 * r.standard_normal(shape)
        ws[name] = jnp.asarray(v, dtype)
    r = np.random.default_rng([prog.seed, prog.index, 0, 3])
    a, b = (r.standard_normal((2, prog.batch, prog.d)) * 0.8).astype(np.float64)
    if tied(prog) if ties is None else ties:  # zeros, halves, equal entries
        a, b = (
            np.clip(np.round(a * 2) / 2, -1.5, 1.5),
            np.clip(np.round(b * 2) / 2, -1.5, 1.5),
        )
    return ws, jnp.asarray(a, dtype), jnp.asarray(b, dtype)


def tied(prog: Program) -> bool:
    """Whether the program starts from tied inputs (it has a construct of TIED).

    Such programs store kinks too: at an exact tie a recomputed relu's
    derivative follows the rebuilt value (documented), not ``jax.grad``'s.
    """
    return bool(TIED & prog.constructs)


def _revnet_scan(prog: Program):
    return functools.partial(revnet.scan, kinks="store") if tied(prog) else revnet.scan


def build(prog: Program, plain: bool = False, probe=None):
    """Builds ``f(a, b)`` of a program with ``exec``; returns ``(f, holder)``.

    Args:
      prog: the program.
      plain: build the plain reference: ``revnet.scan``, ``jax.lax.scan`` and
        ``jax.lax.fori_loop`` run as Python loops and ``jax.jit`` is a plain call.
      probe: build the probed plain reference: ``probe(*arrays)`` is called after
        each op.
    """
    holder: dict = {"ws": None, "s": 1.0}
    plain = plain or probe is not None
    ns = {
        "jax": PLAIN_JAX if plain else jax,
        "jnp": jnp,
        "np": np,
        "revnet": PLAIN_REVNET if plain else revnet,
        "holder": holder,
        "SCAN": py_scan if plain else _revnet_scan(prog),
        "PROBE": probe,
        "grad_reverse": gradients.grad_reverse,
        "grad_clip": gradients.grad_clip,
        "grad_scale": gradients.grad_scale,
        "grad_scaler": gradients.grad_scaler,
        "ste_scale": gradients.ste_scale,
        "ste_sinh": gradients.ste_sinh,
        "ste_asinh": gradients.ste_asinh,
        "ste_round": gradients.ste_round,
        "ste_sign": gradients.ste_sign,
    }
    exec(prog.source(probe=probe is not None), ns)  # noqa: S102
    return ns["f"], holder
