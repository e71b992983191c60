"""The dtype families of the programs, their tolerances and bounds."""

import jax.numpy as jnp

FAMILIES = {  # name: (stream dtype, x64)
    "f32": (jnp.float32, False),
    "f32x64": (jnp.float32, True),
    "f64": (jnp.float64, True),
    "f16": (jnp.float16, False),
    "bf16": (jnp.bfloat16, False),
}
HALF = ("f16", "bf16")
FULL = ("f32", "f32x64", "f64")
ALL = FULL + HALF
FAMILY_WEIGHTS = {"f32": 3.0, "f32x64": 1.0, "f64": 3.0, "f16": 1.0, "bf16": 1.0}
# Every this-many-th program is also called eagerly, outside jax.grad.
EAGER_EVERY = 4
# Every this-many-th program in full precision also has forward mode checked:
# refused through the call, and forward over reverse equal to plain JAX's.
FORWARD_EVERY = 8
# Random perturbations of the outputs tried by ill_conditioned.
PROBES = 6
# Largest |intermediate| of the plain forward pass for a program to be counted.
BOUND = {"f32": 20.0, "f32x64": 20.0, "f64": 20.0, "f16": 8.0, "bf16": 8.0}
DTYPE_SRC = {
    jnp.dtype(jnp.float16): "jnp.float16",
    jnp.dtype(jnp.bfloat16): "jnp.bfloat16",
    jnp.dtype(jnp.float32): "jnp.float32",
    jnp.dtype(jnp.float64): "jnp.float64",
}
