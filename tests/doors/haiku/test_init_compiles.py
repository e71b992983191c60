"""A reversible stack's ``init`` compiles about as much as its standard twin's.

Each count is taken in a fresh interpreter: the programs JAX has compiled
already (the PRNG's, eager scalars) would otherwise be counted by whichever
model runs first only.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_python

# What one interpreter runs: a stack of 8 couplings, its init under
# ``jax.log_compiles``, and the count of "Compiling ..." records as JSON.
_PROGRAM = """
import json, logging, sys
import haiku as hk, jax, jax.numpy as jnp
from revnet import blocks

reversible, layer = sys.argv[1] == "reversible", sys.argv[2]
names = []

class Compiles(logging.Handler):
    def emit(self, record):
        if record.getMessage().startswith("Compiling"):
            names.append(record.getMessage()[:80])

def branch(u):
    h = hk.Linear(8)(u)
    if layer == "batchnorm":
        h = hk.BatchNorm(True, True, 0.9)(h, True)
    if layer == "dropout":
        h = hk.dropout(hk.next_rng_key(), 0.1, h)
    return jnp.tanh(h)

def forward(x):
    block = lambda h: blocks.AdditiveCoupling(branch, branch)(h)
    return blocks.ReversibleSequence(block, num_layers=8, reversible=reversible)(x)

logger = logging.getLogger("jax")
logger.addHandler(Compiles())
logger.setLevel(logging.DEBUG)
with jax.log_compiles(True):
    hk.transform_with_state(forward).init(jax.random.PRNGKey(0), jnp.ones((4, 16)))
print(json.dumps(names))
"""


def _compiles(kind: str, layer: str) -> list[str]:
    out = run_python("-c", _PROGRAM, kind, layer, devices=None, timeout=300)
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("layer", ["linear", "batchnorm", "dropout"])
def test_reversible_init_compiles_at_most_half_again_its_twin(layer):
    twin = _compiles("standard", layer)
    reversible = _compiles("reversible", layer)
    assert twin, "the count saw no compilation: the log format changed"
    assert len(reversible) <= 1.5 * len(twin), (reversible, twin)
