"""The one package that touches jaxpr internals.

Everything revnet needs to know about how JAX represents a traced program lives
here: which primitives are nested calls and where they keep their body, how to
bind a single equation, how to recognise a literal or a dropped variable, and
how to read an equation's source line. JAX promises no stability for these
details (``jax.extend`` is explicitly unstable, primitive names change,
``pjit`` became ``jit``), so a JAX upgrade should only ever need to touch this
package. It is a leaf: it imports no other engine module.

The rest of revnet sees equations through a handful of small functions:

* :func:`call_body` returns the body of a nested call equation, or ``None``;
* :func:`scan_params` describes a ``scan`` equation;
* :func:`bind` runs one equation on concrete or traced values;
* :func:`where` names the user's source line of an equation.

One file a concern: :mod:`.atoms` (variables, literals, abstract values),
:mod:`.bodies` (nested jaxprs, prepared by the pass :func:`set_prepare`
installs), :mod:`.hijax` (JAX's hijax primitives), :mod:`.calls` (nested-call
equations), :mod:`.branches` (``cond``, ``while``), :mod:`.scans`,
:mod:`.sharded` (``shard_map``), :mod:`.evaluate` (binding equations),
:mod:`.source` (source lines), :mod:`.rewrite` (building equations) and
:mod:`.version` (the JAX releases it is written for).
"""

# version first: importing it refuses a JAX release this package cannot read.
from revnet._engine.jaxpr import version, vmappable
from revnet._engine.jaxpr.atoms import (
    Jaxpr,
    JaxprEqn,
    Literal,
    Var,
    aval,
    aval_key,
    has_zero_derivative,
    is_dropvar,
    is_literal,
    is_ref,
    literal_key,
    literal_value,
    mat_key,
    new_var,
    primitive_name,
    row,
    scalar_aval,
    sharding_key,
    stacked,
    struct,
)
from revnet._engine.jaxpr.bodies import (
    Body,
    as_body,
    closed_consts,
    eval_body,
    nested_jaxpr,
    set_prepare,
)
from revnet._engine.jaxpr.branches import (
    cond_branches,
    cond_with_branches,
    while_bodies,
)
from revnet._engine.jaxpr.calls import (
    JIT_NAMES,
    LoopTag,
    call_body,
    call_name,
    call_primitive_names,
    custom_ivjp_match,
    custom_rule_kind,
    custom_vjp_bwd,
    key_params,
    plain_call_jaxpr,
    shapes_key,
    tag,
    tag_kind,
    tag_of,
)
from revnet._engine.jaxpr.evaluate import (
    bind,
    bind_params,
    context,
    eval_with,
)
from revnet._engine.jaxpr.hijax import (
    HI_CALL,
    REVNET_CALL,
    hi_kind,
    lower_refs,
    scan3_refusal,
)
from revnet._engine.jaxpr.rewrite import (
    inline_body,
    live_equations,
    remat_with_body,
    restrict,
    splice,
    with_inputs,
    with_outputs,
)
from revnet._engine.jaxpr.scans import ScanParams, scan, scan_params, scan_with_body
from revnet._engine.jaxpr.sharded import (
    ShardMapParams,
    shard_map,
    shard_map_params,
    within_shard_map,
)
from revnet._engine.jaxpr.source import caller_site, library_where, site_line, where

__all__ = [
    "HI_CALL",
    "REVNET_CALL",
    "JIT_NAMES",
    "Body",
    "Jaxpr",
    "JaxprEqn",
    "Literal",
    "LoopTag",
    "ScanParams",
    "ShardMapParams",
    "Var",
    "as_body",
    "aval",
    "aval_key",
    "bind",
    "bind_params",
    "call_body",
    "call_name",
    "call_primitive_names",
    "caller_site",
    "closed_consts",
    "cond_branches",
    "cond_with_branches",
    "context",
    "custom_ivjp_match",
    "custom_rule_kind",
    "custom_vjp_bwd",
    "eval_body",
    "eval_with",
    "has_zero_derivative",
    "hi_kind",
    "inline_body",
    "is_dropvar",
    "is_literal",
    "is_ref",
    "key_params",
    "literal_key",
    "literal_value",
    "live_equations",
    "lower_refs",
    "mat_key",
    "nested_jaxpr",
    "plain_call_jaxpr",
    "new_var",
    "primitive_name",
    "remat_with_body",
    "restrict",
    "row",
    "scalar_aval",
    "scan",
    "scan3_refusal",
    "scan_params",
    "scan_with_body",
    "set_prepare",
    "shard_map",
    "shard_map_params",
    "shapes_key",
    "sharding_key",
    "splice",
    "stacked",
    "version",
    "vmappable",
    "struct",
    "tag",
    "tag_kind",
    "tag_of",
    "library_where",
    "site_line",
    "where",
    "while_bodies",
    "with_inputs",
    "with_outputs",
    "within_shard_map",
]
