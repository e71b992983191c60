"""The package's structure: explicit registrations, no import cycles, no
import up the layers, a leaf jaxpr package, small files and small functions;
and no test that patches revnet.

These tests read the source (``ast``) and the engine's tables; they compile
nothing.
"""

from __future__ import annotations

import ast
import pathlib

import revnet  # noqa: F401  (fills the engine's tables)
from revnet._engine import interpreter, registry
from revnet._engine.jaxpr import bodies

ROOT = pathlib.Path(revnet.__file__).parent
ENGINE = "revnet._engine"
JAXPR = "revnet._engine.jaxpr"
STRUCTURAL = "revnet._engine.structural"
FRONT_DOOR_LAYER = "revnet._layers"
DECISIONS = "revnet._engine.decisions"
# The decision machinery's modules that the rest of revnet may import: the
# package itself (expose, Exposed, Kept, ...) and the residuals' report, which
# every forward pass calls.
DECISIONS_SURFACE = {DECISIONS, f"{DECISIONS}.residuals"}
MAX_LINES = 450
MAX_FUNCTION_LINES = 100

# The layers, from the bottom: a module imports modules of its own layer and
# of the layers below, never above. "core" is the rest of the engine (analysis,
# plan, interpreter, registry, ...); "surface" is revnet/_engine/__init__.py;
# "outside" is revnet outside the engine (front-ends, rules, front doors).
LAYERS = ("jaxpr", "core", "loops", "structural", "surface", "outside")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _sources() -> dict[str, pathlib.Path]:
    """Every module of ``revnet`` by its dotted name."""
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


MODULES = _sources()


def _imports(name: str, *, top_level_only: bool = False) -> set[str]:
    """The ``revnet`` modules that module ``name`` imports, by name.

    ``from package import name`` counts as an import of the submodule
    ``package.name`` when there is one, else of ``package``. Imports inside
    functions count too, unless ``top_level_only``.
    """
    path = MODULES[name]
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    nodes = tree.body if top_level_only else ast.walk(tree)
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _from_module(node, name, is_package)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in MODULES else base)
    return {m for m in found if m in MODULES}


def _from_module(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    """The module a ``from ... import`` in module ``name`` imports from,
    relative imports resolved."""
    base = node.module or ""
    if node.level:
        package = name if is_package else name.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    return base


def _defining_modules() -> set[str]:
    """The engine modules whose import registers something in a table."""
    owners = {
        type(rule).__module__
        for rule in map(registry.get, registry.names())
        if rule.structural
    }
    owners |= {type(h).__module__ for h in interpreter._HANDLERS.values()}
    owners |= {fn.__module__ for fn in registry._EVALUATORS.values()}
    owners |= {fn.__module__ for fn in bodies._PREPARE}
    return {m for m in owners if m.startswith(ENGINE + ".")}


def test_structural_rules_are_registered_by_explicit_import():
    """Each module of ``_engine/structural/`` defines a structural rule, every
    structural rule is defined there, and ``_engine/__init__.py`` imports each
    module by name; ``structural/__init__.py`` imports none of them."""
    inside = {m for m in MODULES if m.startswith(STRUCTURAL + ".")}
    rules = {
        type(rule).__module__
        for rule in map(registry.get, registry.names())
        if rule.structural
    }
    assert inside == rules, (
        f"modules of {STRUCTURAL} without a structural rule: {sorted(inside - rules)}"
        f"; structural rules defined elsewhere: {sorted(rules - inside)}"
    )
    missing = sorted(inside - _imports(ENGINE, top_level_only=True))
    assert not missing, f"revnet/_engine/__init__.py does not import {missing}"
    implicit = sorted(_imports(STRUCTURAL))
    assert not implicit, f"revnet/_engine/structural/__init__.py imports {implicit}"


def test_registering_modules_are_imported_explicitly():
    owners = _defining_modules()
    assert {f"{STRUCTURAL}.calls", f"{STRUCTURAL}.slices"} <= owners, owners
    explicit = _imports(ENGINE, top_level_only=True)
    missing = sorted(owners - explicit)
    assert not missing, (
        f"modules registering rules or handlers that revnet/_engine/__init__.py "
        f"does not import by name: {missing}"
    )


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph``, as a path of names, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_no_import_cycle():
    graph = {name: _imports(name) - {name} for name in MODULES}
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _layer(name: str) -> str:
    """The layer (one of ``LAYERS``) of module ``name``."""
    if name == ENGINE:
        return "surface"
    if not name.startswith(ENGINE + "."):
        return "outside"
    package = name.split(".")[2]
    return package if package in ("jaxpr", "loops", "structural") else "core"


def test_no_import_goes_up_the_layers():
    layers = {_layer(m) for m in MODULES}
    assert layers == set(LAYERS), layers
    up = sorted(
        f"{name} ({_layer(name)}) imports {dep} ({_layer(dep)})"
        for name in MODULES
        for dep in _imports(name)
        if LAYERS.index(_layer(dep)) > LAYERS.index(_layer(name))
    )
    order = " < ".join(LAYERS)
    assert not up, f"imports up the layers ({order}):\n" + "\n".join(up)


def test_jaxpr_package_is_a_leaf():
    inside = [m for m in MODULES if m == JAXPR or m.startswith(JAXPR + ".")]
    assert len(inside) > 1, inside
    for name in inside:
        engine = {m for m in _imports(name) if m.startswith(ENGINE)}
        others = sorted(m for m in engine if not m.startswith(JAXPR))
        assert not others, f"{name} imports engine modules {others}"


def test_the_engine_does_not_import_the_front_door_layer():
    # The layer sits above the engine: it imports the engine's surface only.
    engine = [m for m in MODULES if m == ENGINE or m.startswith(ENGINE + ".")]
    for name in engine:
        layers = sorted(m for m in _imports(name) if m.startswith(FRONT_DOOR_LAYER))
        assert not layers, f"{name} imports {layers}"


def private_imports(name: str) -> list[str]:
    """Where module ``name`` reaches another revnet module's private name
    (``from revnet.x import _y``, or ``x._y`` on a module it imported); a
    private *module* (``revnet._engine``) is not a private name."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    bound: dict[str, str] = {}  # local name -> revnet module
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = _from_module(node, name, is_package)
            if base not in MODULES:
                continue
            for alias in node.names:
                if f"{base}.{alias.name}" in MODULES:
                    bound[alias.asname or alias.name] = f"{base}.{alias.name}"
                elif _private(alias.name):
                    found.append(f"line {node.lineno}: from {base} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in MODULES:
                    bound[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and bound.get(node.value.id, name) != name
            and _private(node.attr)
            and f"{bound[node.value.id]}.{node.attr}" not in MODULES
        ):
            found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    return found


def _private(attr: str) -> bool:
    return attr.startswith("_") and not attr.startswith("__")


def test_no_module_imports_another_modules_private_names():
    found = {name: hits for name in MODULES if (hits := private_imports(name))}
    assert not found, found


def test_the_private_import_finder_finds_them(tmp_path):
    """The finder on two modules of its own making: each way of reaching a
    private name is found, and a private module is not one."""
    MODULES["revnet._probe"] = path = tmp_path / "probe.py"
    try:
        path.write_text(
            "from revnet.invertible import _as_output\n"
            "from revnet import _engine\n"
            "import revnet._forward_and_log_det as ld\n"
            "ld._check_square\n"
            "_engine.trace\n"
        )
        assert private_imports("revnet._probe") == [
            "line 1: from revnet.invertible import _as_output",
            "line 4: ld._check_square",
        ]
    finally:
        del MODULES["revnet._probe"]


def test_every_folder_of_the_package_is_a_package():
    """A folder of modules without ``__init__.py`` imports from a checkout
    (a namespace package) but is left out of the wheel and the sdist, which
    list packages by ``find:``."""
    folders = {p.parent for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts}
    missing = sorted(
        str(f.relative_to(ROOT.parent))
        for f in folders
        if not (f / "__init__.py").exists()
    )
    assert not missing, missing


def test_the_decision_machinery_lives_in_one_folder():
    """The decision pass, its nested calls, continuity, replays and records
    are modules of ``_engine/decisions/``, imported only from inside it; the
    rest of revnet reaches them through the package."""
    inside = {m for m in MODULES if m.startswith(DECISIONS + ".")}
    for part in ("rewrite", "nested", "continuity", "replays", "record"):
        assert f"{DECISIONS}.{part}" in inside, sorted(inside)
    leaks = sorted(
        f"{name} imports {dep}"
        for name in MODULES
        if name != DECISIONS and not name.startswith(DECISIONS + ".")
        for dep in _imports(name)
        if dep in inside and dep not in DECISIONS_SURFACE
    )
    assert not leaks, leaks


def _imported_modules(tree: ast.AST):
    """``(node, module names)`` of every import statement in ``tree``; an
    import of a name from a package (``from jax import _src``) counts as an
    import of the module ``jax._src``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield node, [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            yield node, [base, *(f"{base}.{a.name}" for a in node.names)]


def test_only_the_jaxpr_package_imports_jax_extend():
    for name, path in MODULES.items():
        if name == JAXPR or name.startswith(JAXPR + "."):
            continue
        for _, mods in _imported_modules(ast.parse(path.read_text(), str(path))):
            assert not any(m.startswith("jax.extend") for m in mods), (
                f"{name} imports {mods}"
            )


# The one function that imports JAX's private modules: scans whose inputs
# are described by flat trees have no public constructor.
PRIVATE_JAX = ("revnet._engine.jaxpr.scans", "structure_params")


def test_jax_src_is_imported_in_one_function_only():
    """In the package, its tests, benchmarks, examples and experiments."""
    found = []
    roots = ("revnet", "tests", "benchmarks", "examples", "experiments")
    repo = ROOT.parent
    for path in sorted(p for r in roots for p in (repo / r).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        parents = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
        for node, mods in _imported_modules(tree):
            if not any(m == "jax._src" or m.startswith("jax._src.") for m in mods):
                continue
            scope = node
            while scope in parents and not isinstance(scope, ast.FunctionDef):
                scope = parents[scope]
            fn = scope.name if isinstance(scope, ast.FunctionDef) else None
            mod = ".".join(path.relative_to(repo).with_suffix("").parts)
            found.append((mod, fn))
    assert found == [PRIVATE_JAX], found


def test_no_file_over_the_line_limit():
    long = {
        str(p.relative_to(ROOT.parent)): n
        for p in MODULES.values()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines: {long}"


def _function_lengths(path: pathlib.Path):
    """``(name, line, length)`` of every function (methods and nested functions
    too) in ``path``: its length runs from the first statement after its
    docstring to its last line."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = node.body[1:] if ast.get_docstring(node) is not None else node.body
        if body:
            yield node.name, node.lineno, node.end_lineno - body[0].lineno + 1


def test_no_function_over_the_line_limit():
    long = {
        f"{p.relative_to(ROOT.parent)}:{line} {name}": n
        for p in MODULES.values()
        for name, line, n in _function_lengths(p)
        if n > MAX_FUNCTION_LINES
    }
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def _revnet_names(tree: ast.Module) -> set[str]:
    """The names a test module binds to ``revnet`` modules or their objects."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {
                (a.asname or a.name).split(".")[0]
                for a in node.names
                if a.name.split(".")[0] == "revnet"
            }
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "revnet"
        ):
            names |= {a.asname or a.name for a in node.names}
    return names


_MUTATORS = {"append", "extend", "insert", "remove", "pop", "clear", "update"}
_MUTATORS |= {"setdefault", "add", "discard", "__setitem__", "__delitem__"}


def private_patches(source: str) -> list[str]:
    """Where test ``source`` replaces an attribute of a revnet module or object:
    ``setattr`` (``monkeypatch.setattr`` included) on one, an assignment to
    one of its attributes or items, or a mutating method of a private one
    (``loops._HOOKS.append``). Tests reach revnet through its API or a documented
    hook (``revnet._engine.loops.hooks``, ``residuals.hooks_off``), never a patch."""
    tree = ast.parse(source)
    ours = _revnet_names(tree)

    def revnet_object(node: ast.expr) -> bool:
        while isinstance(node, ast.Attribute):
            node = node.value
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value.startswith("revnet")
        return isinstance(node, ast.Name) and node.id in ours

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            name = (
                func.attr
                if isinstance(func, ast.Attribute)
                else getattr(func, "id", None)
            )
            if name in ("setattr", "delattr") and revnet_object(node.args[0]):
                found.append(f"line {node.lineno}: {name}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value  # a private list or dict of revnet, mutated
            if (
                node.func.attr in _MUTATORS
                and isinstance(owner, ast.Attribute)
                and owner.attr.startswith("_")
                and revnet_object(owner.value)
            ):
                found.append(f"line {node.lineno}: mutates {ast.unparse(owner)}")
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Subscript):
                target = target.value
            if isinstance(target, ast.Attribute) and revnet_object(target.value):
                found.append(f"line {node.lineno}: assigns {ast.unparse(target)}")
    return found


def test_no_test_patches_revnet():
    tests = ROOT.parent / "tests"
    found = {
        str(path.relative_to(tests)): hits
        for path in sorted(tests.rglob("*.py"))
        if (hits := private_patches(path.read_text()))
    }
    assert not found, found


def test_the_patch_finder_finds_patches():
    source = (
        "from revnet._engine.loops import choose\n"
        "import revnet.loops as loops\n"
        "def test(monkeypatch):\n"
        "    monkeypatch.setattr(choose, 'choose_mode', None)\n"
        "    monkeypatch.setattr('revnet.loops.scan', None)\n"
        "    loops._HOOKS = []\n"
        "    setattr(choose.x, 'y', 1)\n"
        "    loops._BACKWARD_STEP_HOOKS.append(print)\n"
        "    loops.scan(print)\n"
        "    loops._TABLE['x'] = 1\n"
        "    loops._TABLE.values()\n"
    )
    assert len(private_patches(source)) == 6, private_patches(source)
    assert private_patches("import os\nos.environ['X'] = '1'\n") == []
