"""The README, CONTRIBUTING.md and docs/ run as written, and mean what they say.

The rule for every page: each ```python block is self-contained. It imports
what it uses and makes its own data, assuming the reader ran nothing before it
(no earlier block, no setup), so each one runs here on its own, in a fresh
namespace. Line numbers in a failing block's traceback are its file's.

* ``test_block_runs`` runs every block, named by its file, line and section
  heading. Blocks that need a fresh interpreter (forced CPU devices, several
  processes) are listed in ``SUBPROCESS`` with the reason and run in the slow
  tier; every other block takes a few seconds in this process. A block that
  imports ``flax``, ``equinox`` or a simulation package (``jax_md``,
  ``diffrax``, ``fdtdx``) is skipped when that package is missing.
  Where a block's result can be checked cheaply, ``CHECKS`` does so against
  plain ``jax.grad`` (or the page's own claim).
* ``test_every_block_is_run`` counts the fences a second way, so a new block
  cannot be left out silently.
* The ``bash`` blocks and the ``make`` commands in the text name only
  Makefile targets, command-line flags and extras that exist.
* The examples of the docstrings ``help(revnet)`` shows first run.
"""

from __future__ import annotations

import configparser
import doctest
import functools
import pathlib
import re
import shlex
import socket
import subprocess
import sys

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import revnet
import revnet.blocks
from tests.helpers import (
    ROOT,
    assert_trees_close,
    run_python,
    subprocess_env,
    tolerance,
)

PAGES = [
    pathlib.Path(ROOT) / "README.md",
    pathlib.Path(ROOT) / "CONTRIBUTING.md",
    *sorted((pathlib.Path(ROOT) / "docs").rglob("*.md")),
]
TEXTS = {page: page.read_text() for page in PAGES}
F32 = tolerance("float32")


def _name(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


def _blocks(lang: str) -> list[tuple[pathlib.Path, int, str, str]]:
    """``(page, first code line, section heading, code)`` of every ```lang
    block of every page."""
    found = []
    for page, text in TEXTS.items():
        heading, code, start = "", None, 0
        for n, line in enumerate(text.splitlines(), 1):
            if code is None and line.startswith("#"):
                heading = line.lstrip("#").strip()
            elif code is None and line.strip() == f"```{lang}":
                code, start = [], n + 1
            elif code is not None and line.strip() == "```":
                found.append((page, start, heading, "\n".join(code) + "\n"))
                code = None
            elif code is not None:
                code.append(line)
    return found


BLOCKS = _blocks("python")
HEADINGS = [heading for _, _, heading, _ in BLOCKS]

# Blocks that need a fresh interpreter, by section heading, with the reason.
# They run in the slow tier (pyproject.toml: subprocess and multi-process runs).
SUBPROCESS = {
    "Scaling out": "sets 8 CPU devices before JAX starts",
    "Setting up": "two processes under jax.distributed",
}


def _block_id(index: int) -> str:
    page, line, heading, code = BLOCKS[index]
    first = code.strip().splitlines()[0][:40]
    return f"{_name(page)}:{line}: {heading} ({first})"


# --------------------------------------------------------------------------- #
# Checks of meaning, keyed by a line that appears in exactly one block. Each
# takes the block's namespace and what it printed.


def _check_quick_start(ns, out):
    plain = ns["net"].__wrapped__
    want = jax.grad(
        lambda a, b: sum(jnp.sum(y**2) for y in plain(a, b)), argnums=(0, 1)
    )(ns["x"], ns["x"])
    assert_trees_close(ns["grads"], want, F32, "grads")
    assert_trees_close((ns["x1"], ns["x2"]), (ns["x"], ns["x"]), F32, "inverse")


def _check_custom_ivjp(ns, out):
    plain = ns["f"].fun  # the undecorated function: plain autodiff
    want = jax.grad(lambda x: jnp.sum(plain(x) ** 2))(ns["x"])
    assert_trees_close(ns["grad"], want, F32, "grad")
    assert_trees_close(ns["x_back"], ns["x"], F32, "inverse")


def _check_runtime_checks(ns, out):
    first, *rest = out.splitlines()
    want = jax.grad(lambda w, x: jnp.sum(jnp.sinh(x * w) ** 2))(0.5, ns["x"])
    assert_trees_close(jnp.float32(float(first)), want, F32, "printed gradient")
    assert "non-finite value from finite values" in "\n".join(rest), out


def _check_own_block(ns, out):
    twin = jax.grad(lambda p: ns["loss"](p, reversible=False))(ns["params"])
    assert_trees_close(ns["grads"], twin, F32, "grads")
    leaves = jax.tree.leaves(ns["grads"])
    assert len(leaves) == 6, "MLP (2 layers) and Linear: weights and biases"
    assert all(float(abs(g).max()) > 0 for g in leaves), "a zero gradient"


def _check_compute_dtype(ns, out):
    assert ns["y"].dtype == jnp.float32, "the residual stream stays in float32"
    for g, p in zip(jax.tree.leaves(ns["grads"]), jax.tree.leaves(ns["params"])):
        assert g.dtype == p.dtype == jnp.float32
        assert bool(jnp.all(jnp.isfinite(g))) and float(jnp.abs(g).max()) > 0
    # The same parameters without compute_dtype: the blocks really ran in bfloat16.
    from revnet import blocks

    f32 = hk.transform(lambda x: blocks.ReversibleSequence(ns["block"], 16)(x))
    y32 = f32.apply(ns["params"], None, ns["x"])
    assert float(jnp.max(jnp.abs(ns["y"] - y32))) > 0, "compute_dtype had no effect"


def _check_ready_made(ns, out):
    assert_trees_close(ns["x_back"], ns["x"], F32, "inverse")


def _check_loops(ns, out):
    # Plain JAX takes as many steps (lax.while_loop, same float32 clock), then
    # jax.grad differentiates the same steps unrolled.
    leapfrog, t_end = ns["leapfrog"], ns["t_end"]
    q0, p0 = ns["q0"], ns["p0"]
    _, _, _, steps = jax.lax.while_loop(
        lambda s: s[2] < t_end,
        lambda s: (*leapfrog(s[:3]), s[3] + 1),
        (q0, p0, jnp.float32(0.0), 0),
    )

    def plain(q0):
        state = (q0, p0, 0.0)
        for _ in range(int(steps)):
            state = leapfrog(state)
        return jnp.sum(state[0] ** 2)

    assert int(steps) > 1
    assert_trees_close(
        ns["grads"], jax.grad(plain)(q0), tolerance("float32", loops=True)
    )


def _check_drift(ns, out):
    latest = ns["monitor"].latest
    assert latest is not None and latest.shape == (8,), latest  # 128 / 16 anchors
    assert np.all(np.isfinite(latest)), latest


def _check_haiku_quick_start(ns, out):
    # The same parameters through the reversible=False twin: equal gradients.
    from revnet import blocks

    twin = hk.transform(
        lambda x: blocks.ReversibleSequence(ns["block"], 32, reversible=False)(x)
    )

    def grads(model):
        loss = lambda p: jnp.mean(model.apply(p, None, ns["x"]) ** 2)  # noqa: E731
        return jax.grad(loss)(ns["params"])

    assert_trees_close(grads(ns["model"]), grads(twin), F32, "grads")
    assert bool(jnp.isfinite(ns["loss"])) and float(ns["loss"]) > 0


def _check_nnx(ns, out, num_layers=16):
    # "equal to the reversible=False twin's": the twin, built from the same
    # Rngs, takes the same first step.
    from flax import nnx

    import revnet.nnx

    twin = revnet.nnx.ReversibleSequence(
        ns["Block"], num_layers=num_layers, rngs=nnx.Rngs(0), reversible=False
    )
    optimizer = nnx.Optimizer(twin, ns["optax"].adam(1e-3), wrt=nnx.Param)
    want = ns["train_step"](twin, optimizer, ns["x"])
    assert_trees_close(ns["loss"], want, F32, "loss")
    assert float(ns["loss"]) > 0


def _check_eqx_quick_start(ns, out):
    # The twin with the same key and reversible=False takes the same step.
    import equinox as eqx

    import revnet.eqx

    twin = revnet.eqx.ReversibleSequence(
        ns["make_block"], 32, key=jax.random.key(0), reversible=False
    )
    opt_state = ns["optimiser"].init(eqx.filter(twin, eqx.is_inexact_array))
    *_, want = ns["step"](twin, opt_state, ns["x"])
    assert_trees_close(ns["loss"], want, F32, "loss")
    assert float(ns["loss"]) > 0


def _check_eqx(ns, out):
    # The non-reversible twin with the same key takes the same step.
    import equinox as eqx

    import revnet.eqx

    twin, state = eqx.nn.make_with_state(revnet.eqx.ReversibleSequence)(
        ns["make_block"], 32, key=jax.random.key(0), reversible=False
    )
    opt_state = ns["optimiser"].init(eqx.filter(twin, eqx.is_inexact_array))
    *_, want = ns["step"](twin, state, opt_state, ns["x"], jax.random.key(2))
    assert_trees_close(ns["value"], want, F32, "loss")
    assert float(ns["value"]) > 0


def _check_readme_flow(ns, out):
    # The per-example log-det is the Jacobian's; the gradient is plain JAX's.
    ws, x, plain = ns["ws"], ns["x"], ns["flow"].__wrapped__
    log_det = plain(ws, x)[1]
    assert_trees_close(ns["flow"](ws, x)[1], log_det, F32, "log_det")
    for i in (0, 5):
        jac = jax.jacfwd(lambda v, i=i: plain(ws, x.at[i].set(v))[0][i])(x[i])
        assert_trees_close(log_det[i], jnp.linalg.slogdet(jac)[1], F32, "slogdet")

    def nll(ws):
        z, ld = plain(ws, x)
        return -jnp.mean(jax.scipy.stats.norm.logpdf(z).sum(-1) + ld)

    assert_trees_close(ns["grads"], jax.grad(nll)(ws), F32, "gradient")


CHECKS = {
    "the per-example log-det rides in the carry": _check_readme_flow,
    "x1, x2 = revnet.inverse(net, x, x)(net(x, x))": _check_quick_start,
    "@revnet.custom_ivjp": _check_custom_ivjp,
    "revnet.set_runtime_checks(True)": _check_runtime_checks,
    "reversible=reversible)(x)": _check_own_block,
    "compute_dtype=jnp.bfloat16": _check_compute_dtype,
    "seq.inverse(x) if inverse else seq(x)": _check_ready_made,
    "def leapfrog(state):": _check_loops,
    "anchor_every=16, drift=monitor": _check_drift,
    "revnet.nnx.ReversibleSequence(Block, num_layers=16": _check_nnx,
    "revnet.nnx.ReversibleSequence(Block, num_layers=32": functools.partial(
        _check_nnx, num_layers=32
    ),
    "blocks.ReversibleSequence(block, num_layers=32)(x))": _check_haiku_quick_start,
    "ReversibleSequence(make_block, 32, key=jax.random.key(0))": (
        _check_eqx_quick_start
    ),
    "eqx.nn.make_with_state(revnet.eqx.ReversibleSequence)": _check_eqx,
}

# Appended to a subprocess block, where the namespace is not at hand.
SUBPROCESS_CHECKS = {
    # "Under Explicit axes they equal the parameters' own shardings."
    "Scaling out": """
for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params), strict=True):
    assert g.sharding.is_equivalent_to(p.sharding, g.ndim), (g.sharding, p.sharding)
    assert bool(jnp.all(jnp.isfinite(g)))
print("README CHECK OK", len(jax.tree.leaves(grads)))
""",
}


def _checks_of(code: str):
    return [check for key, check in CHECKS.items() if key in code]


# --------------------------------------------------------------------------- #


@pytest.fixture
def restore_runtime_checks():
    yield
    revnet.set_runtime_checks(None)  # a block may turn them on or off


def _skip_missing_packages(code: str) -> None:
    for package, extra in (
        ("haiku", "haiku"),
        ("flax", "nnx"),
        ("equinox", "equinox"),
        ("jax_md", "simulation"),
        ("diffrax", "simulation"),
        ("fdtdx", "simulation"),
    ):
        if re.search(rf"^\s*(import|from)\s+{package}\b", code, re.M):
            reason = f"the block imports {package}: pip install '.[{extra}]'"
            pytest.importorskip(package, reason=reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_processes(code: str, tmp_path, n: int = 2, timeout: float = 600) -> list:
    """Runs ``code`` as a file in ``n`` processes, as the block's comment says."""
    script = tmp_path / "train.py"
    script.write_text(code)
    env = subprocess_env(None, PORT=str(_free_port()))
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env={**env, "PROCESS_ID": str(i)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(n)
    ]
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for proc, out in zip(procs, outs):
        assert proc.returncode == 0, out[-4000:]
    return outs


def _run_in_subprocess(index: int, tmp_path) -> None:
    _, _, heading, code = BLOCKS[index]
    if heading == "Setting up":
        outs = _run_processes(code, tmp_path)
        losses = [re.findall(r"process (\d): loss (\S+)", out) for out in outs]
        assert [found[0][0] for found in losses] == ["0", "1"], outs
        assert losses[0][0][1] == losses[1][0][1], "one global loss"
        return
    out = run_python("-c", code + SUBPROCESS_CHECKS.get(heading, ""), devices=None)
    if heading in SUBPROCESS_CHECKS:
        assert "README CHECK OK" in out, out


def _params():
    cases = []
    for index, (_, _, heading, _) in enumerate(BLOCKS):
        marks = [pytest.mark.slow] if heading in SUBPROCESS else []
        cases.append(pytest.param(index, id=_block_id(index), marks=marks))
    return cases


@pytest.mark.parametrize("index", _params())
def test_block_runs(index, tmp_path, capsys, restore_runtime_checks):
    page, line, heading, code = BLOCKS[index]
    _skip_missing_packages(code)
    if heading in SUBPROCESS:
        _run_in_subprocess(index, tmp_path)
        return
    ns: dict = {"__name__": f"docs_block_{index}"}
    padded = "\n" * (line - 1) + code  # tracebacks show the page's line numbers
    exec(compile(padded, str(page), "exec"), ns)  # noqa: S102
    jax.effects_barrier()
    out = capsys.readouterr().out
    for check in _checks_of(code):
        check(ns, out)


def test_every_block_is_run():
    fences = sum(
        len(re.findall(r"^```python\s*$", text, re.M)) for text in TEXTS.values()
    )
    assert fences == len(BLOCKS) == len(_params()), "a ```python block is not run"
    assert PAGES[0] in {page for page, *_ in BLOCKS}, "the README has no block"
    assert len(BLOCKS) >= 20
    for heading in SUBPROCESS:
        assert HEADINGS.count(heading) == 1, f"SUBPROCESS names {heading!r}"
    for heading in SUBPROCESS_CHECKS:
        assert heading in SUBPROCESS, heading
    for key in CHECKS:
        found = [i for i, (*_, code) in enumerate(BLOCKS) if key in code]
        assert len(found) == 1, f"CHECKS key {key!r} is in blocks {found}"


def test_readme_quick_starts_are_short():
    quick = [
        (heading, code)
        for page, _, heading, code in BLOCKS
        if page == PAGES[0] and heading in ("The core", "Haiku", "Flax NNX", "Equinox")
    ]
    assert [heading for heading, _ in quick] == [
        "The core", "Haiku", "Flax NNX", "Equinox"
    ]  # fmt: skip
    for heading, code in quick:
        assert len(code.strip().splitlines()) < 25, heading
    assert len(TEXTS[PAGES[0]].splitlines()) <= 300, "the README is for users"


# --------------------------------------------------------------------------- #
# Commands.


def _extras() -> set[str]:
    config = configparser.ConfigParser()
    config.read(pathlib.Path(ROOT) / "setup.cfg")
    return set(config["options.extras_require"])


def _make_targets() -> set[str]:
    makefile = (pathlib.Path(ROOT) / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*):", makefile, re.M))


def _module_help(module: str, capsys) -> str:
    """The ``--help`` text of ``python -m module`` (its argparse, in process)."""
    main = __import__(module, fromlist=["main"]).main
    with pytest.raises(SystemExit):
        main(["--help"])
    return capsys.readouterr().out


def test_make_commands_name_existing_targets():
    targets = _make_targets()
    assert {"test", "test-all", "demo", "demo-full"} <= targets
    named = {
        target
        for text in TEXTS.values()
        for target in re.findall(r"`make ([a-z][\w-]*)", text)
    }
    assert {"test", "docs", "demo"} <= named, "the pages name no make target"
    assert named <= targets, f"not in the Makefile: {sorted(named - targets)}"


def test_make_targets_run_what_the_readme_says():
    makefile = (pathlib.Path(ROOT) / "Makefile").read_text()
    demo = re.search(r"^demo:.*\n\t(.*)", makefile, re.M).group(1)
    assert "-m benchmarks.demo --out results" in demo
    pages = "\n".join(TEXTS.values())
    assert "`make demo` (`python -m benchmarks.demo --out results`)" in pages
    full = re.search(r"^demo-full:.*\n\t(.*)", makefile, re.M).group(1)
    assert "-m benchmarks.run --quick --out results/full" in full
    assert "`make demo-full` (`python -m benchmarks.run --quick" in pages
    test = re.search(r"^test:.*\n\t(.*)", makefile, re.M).group(1)
    assert '-m "not slow"' in test


def _recipe(makefile: str, target: str) -> list[str]:
    """The command lines of ``target``'s recipe, continuation lines joined."""
    found = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n?)*)", makefile, re.M)
    assert found, f"no target {target}"
    return found.group(1).replace("\\\n", " ").split("\n")


def test_make_docs_builds_strict_and_not_quiet():
    """``-q`` lowers mkdocs 1.6's log level to ERROR, so ``--strict`` would see
    no warning and a broken link would build (tests/project/test_docs_site.py
    builds one)."""
    makefile = (pathlib.Path(ROOT) / "Makefile").read_text()
    builds = [
        shlex.split(line)
        for line in _recipe(makefile, "docs")
        if re.search(r"\bmkdocs build\b", line)
    ]
    assert builds, "make docs runs no mkdocs build"
    ci = (pathlib.Path(ROOT) / ".ci" / "run").read_text()
    runs_docs = re.search(r"^(step )?make docs( JAX=\w+)?$", ci, re.M)
    assert runs_docs, "CI does not run make docs"
    builds += [shlex.split(line) for line in ci.splitlines() if "mkdocs" in line]
    for argv in builds:
        assert "--strict" in argv, argv
        quiet = [a for a in argv if a == "--quiet" or re.fullmatch(r"-\w*q\w*", a)]
        assert not quiet, argv


def test_bash_blocks_name_existing_flags(capsys):
    from benchmarks import BENCHMARKS

    targets = _make_targets()
    commands = [
        shlex.split(line.split("#")[0])
        for *_, code in _blocks("bash")
        for line in code.splitlines()
        if line.split("#")[0].strip()
    ]
    assert commands
    extras = _extras()
    for argv in commands:
        if argv[0] == "make":
            assert argv[1] in targets, argv
            continue
        if argv[:2] == ["pip", "install"]:
            # `pip install .` or `pip install '.[extra]'`, from a clone.
            found = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", argv[2])
            assert found and len(argv) == 3, argv
            named = set((found.group(1) or "").split(",")) - {""}
            assert named <= extras, f"setup.cfg has no extra {named - extras}"
            continue
        assert argv[0].endswith("python") and argv[1] == "-m", argv
        module = argv[2]
        flags = [a.split("=")[0] for a in argv[3:] if a.startswith("--")]
        text = _module_help(module, capsys)
        for flag in flags:
            assert re.search(rf"{flag}\b", text), f"{module} has no {flag}"
        if module == "benchmarks.run" and "--only" in argv:
            names = argv[argv.index("--only") + 1].split(",")
            assert set(names) <= set(BENCHMARKS), names


# --------------------------------------------------------------------------- #
# help(revnet): the examples of the docstrings it shows first.


DOCUMENTED = {
    "revnet": revnet,
    "revnet.blocks": revnet.blocks,
    "revnet.DriftMonitor": revnet.DriftMonitor,
}


@pytest.mark.parametrize("name", DOCUMENTED)
def test_docstring_example_runs(name, restore_runtime_checks):
    tests = doctest.DocTestFinder(recurse=False).find(DOCUMENTED[name], globs={})
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted >= 5, "the docstring has an example"
    assert result.failed == 0
