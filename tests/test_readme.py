"""The README's quick start runs and means what it says."""

import pathlib
import re

import jax

from tests.helpers import assert_trees_close

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_quick_start_runs_and_matches_plain_autodiff():
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    ns: dict = {}
    exec(compile(code, "README.md", "exec"), ns)  # noqa: S102
    plain = ns["net"].__wrapped__
    want = jax.grad(
        lambda a, b: sum(jax.numpy.sum(y**2) for y in plain(a, b)), argnums=(0, 1)
    )(ns["x"], ns["x"])
    assert_trees_close(ns["grads"], want, 1e-5, "grads")
    assert_trees_close((ns["x1"], ns["x2"]), (ns["x"], ns["x"]), 1e-5, "inverse")


def test_bring_your_own_block_matches_the_twin():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    code = next(b for b in blocks if "def block(h)" in b)
    ns: dict = {}
    exec(compile(code, "README.md", "exec"), ns)  # noqa: S102
    twin = jax.grad(lambda p: ns["loss"](p, reversible=False))(ns["params"])
    assert_trees_close(ns["grads"], twin, 1e-5, "grads")
    leaves = jax.tree.leaves(ns["grads"])
    assert len(leaves) == 6, "MLP (2 layers) and Linear: weights and biases"
    assert all(float(abs(g).max()) > 0 for g in leaves), "a zero gradient"
