"""The generation state that every construct's op generator draws from."""

from collections.abc import Iterable

import jax.numpy as jnp
import numpy as np

from tests.fuzz.families import FAMILIES


class Gen:
    """Generation state of one program: randomness, weights, stream dtypes."""

    def __init__(self, rng: np.random.Generator, family: str, d: int, batch: int):
        self.rng = rng
        self.family = family
        self.d = d
        self.batch = batch
        self.weights: dict[str, tuple[tuple[int, ...], str]] = {}
        self.dtypes = {"a": jnp.dtype(FAMILIES[family][0])}
        self.dtypes["b"] = self.dtypes["a"]
        self.n = 0  # index of the op being generated: names its weights
        self.tied = False  # whether the inputs will be tied (constructs.TIED)

    def c(self, lo: float = 0.1, hi: float = 1.0) -> str:
        return f"{self.rng.uniform(lo, hi):.3g}"

    def w(self, shape: Iterable[int], kind: str = "normal") -> str:
        name, k = f"w{self.n}", 0
        while name in self.weights:  # the op's second weight, or third
            k += 1
            name = f"w{self.n}_{k}"
        self.weights[name] = (tuple(shape), kind)
        return f'w["{name}"]'

    def pick(self, options):
        return options[int(self.rng.integers(len(options)))]
