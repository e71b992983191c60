"""The inversion engine: the internal surface revnet's front-ends share.

Data flows one way: a function is traced and prepared by :mod:`.jaxpr` (the
only module that touches ``jax.extend``), :mod:`.analysis` turns the jaxpr
into a :class:`~.plan.Plan` with the rules of :mod:`.registry`, and
:mod:`.interpreter` runs the plan on values and cotangents. Structural rules
(:mod:`.structural`: calls, ``scan``, ``select_n``, slices, ``shard_map``) add
themselves to the registry and to the interpreter's handler table when this
package is imported; :mod:`.sharded_types` gives rebuilt values their types. The
front-ends (``revnet.invertible``, ``revnet.ivjp``, ``revnet.loops``) and
``revnet.rules`` import only the names below, and the engine imports no
front-end.
"""

# The modules marked "registers" add structural rules, plan-step handlers or
# evaluators to the engine's tables when imported: they are imported here on
# purpose, each by name (tests/engine/test_structure.py fails if one is missing).
from revnet._engine import (
    boundary,
    cotangents,
    elimination,  # noqa: F401  (registers: the handler of linear elimination)
    fast_convolutions,  # noqa: F401  (registers: the convolution evaluator)
    known_args,
    known_bodies,  # noqa: F401  (registers: library bodies solved in closed form)
    log_det,
    masks,  # noqa: F401  (registers: the handler of a masked coupling)
    perturbed,
    ratios,  # noqa: F401  (registers: the handler of an unknown in a quotient)
    registry,
    reversible_call,
    runtime_checks,
    sharded_types,
    tracing,  # noqa: F401  (registers: the preparation of nested jaxpr bodies)
)
from revnet._engine.analysis import PLAN_CACHE, analyze, stats
from revnet._engine.batching.axes import reads
from revnet._engine.cache import LRU
from revnet._engine.decisions import (
    DECISION_MARK,
    DECISIONS,
    KINK_MARK,
    KINKS,
    Exposed,
    Kept,
    expose,
    residuals,
    stored_bytes,
)
from revnet._engine.errors import (
    CAST,
    SINGULAR,
    NotInvertibleError,
    Stuck,
    cannot_store,
    leaf_paths,
    not_invertible,
    refusal,
    reverse_mode_only,
    show,
)
from revnet._engine.interpreter import Interpreter
from revnet._engine.jaxpr import Body, ScanParams, aval, eval_body, row, struct, tag
from revnet._engine.loops import choose, revolve, scan_function, while_function
from revnet._engine.loops.batched import scan_call
from revnet._engine.loops.damping import visible_damping
from revnet._engine.loops.revolve import INT32_MAX
from revnet._engine.loops.store import lost_leaves
from revnet._engine.plan import Plan
from revnet._engine.program import (
    Call,
    Program,
    Storage,
    flat_call,
    plan_call,
    prepare,
    solve_exposed,
)
from revnet._engine.registry import (
    DECISION,
    SMOOTH,
    InverseRule,
    InverseRuleFn,
    define,
    register_inverse,
)
from revnet._engine.structural import (
    calls,  # noqa: F401  (registers: nested calls and custom rules)
    scan,  # noqa: F401  (registers: lax.scan)
    select,  # noqa: F401  (registers: select_n with a known predicate)
    shard_map,  # noqa: F401  (registers: shard_map)
    slices,  # noqa: F401  (registers: slices that cover a value together)
)
from revnet._engine.tracing import trace, trace_program

__all__ = [
    "INT32_MAX",
    "boundary",
    "CAST",
    "DECISION",
    "SMOOTH",
    "define",
    "DECISIONS",
    "DECISION_MARK",
    "KINKS",
    "KINK_MARK",
    "Exposed",
    "Kept",
    "expose",
    "stored_bytes",
    "LRU",
    "PLAN_CACHE",
    "Body",
    "Interpreter",
    "InverseRule",
    "InverseRuleFn",
    "NotInvertibleError",
    "Plan",
    "Call",
    "Program",
    "Storage",
    "flat_call",
    "plan_call",
    "prepare",
    "solve_exposed",
    "SINGULAR",
    "ScanParams",
    "Stuck",
    "analyze",
    "aval",
    "cannot_store",
    "runtime_checks",
    "cotangents",
    "eval_body",
    "residuals",
    "known_args",
    "leaf_paths",
    "lost_leaves",
    "visible_damping",
    "log_det",
    "choose",
    "not_invertible",
    "perturbed",
    "reads",
    "sharded_types",
    "show",
    "struct",
    "refusal",
    "reverse_mode_only",
    "register_inverse",
    "registry",
    "reversible_call",
    "revolve",
    "row",
    "scan_call",
    "scan_function",
    "stats",
    "tag",
    "trace",
    "trace_program",
    "while_function",
]
