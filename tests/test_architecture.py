"""The package's import contract, read from its source (ast; nothing is imported): no import cycle among shadow's
modules, no private name (``_x``) imported from another module, no private name of torch's ModuleTracker, the
results side layered as docs/architecture.md draws it, and no module over MAX_LINES lines."""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "shadow"
MAX_LINES = 700  # a module past this is a package waiting to be made: split it along a real seam

# The results side, lowest first: a module may import from its own layer and those below it, never from above.
LAYERS = (
    ("records", ("shadow.savedform", "shadow.metrics", "shadow.records", "shadow.spot.verdict")),
    ("report format", ("shadow.reportformat", "shadow.sidecar")),
    ("report data", ("shadow.reportdata", "shadow.trajectory", "shadow.nonfinite")),
    ("verdict", ("shadow.verdict", "shadow.reportdiff", "shadow.amplification")),
    ("render", ("shadow.tables", "shadow.band", "shadow.report", "shadow.html", "shadow.plots", "shadow.progress", "shadow.repro",
                "shadow.testing")),
    ("cli", ("shadow.cli", "shadow.cli.*")),
)
# what records, reports and verdicts never depend on: the engine side that produces them
ENGINE_SIDE = ("shadow.engine*", "shadow.modes*", "shadow.attribution*", "shadow.precision*", "shadow.replay*",
               "shadow.mirror", "shadow.distributed")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, str, int]]:
    """(module imported, name imported from it or "", line) for each import ``name`` runs: at module level or in a
    function, not those under ``if TYPE_CHECKING:``. A name that is itself a module is the module imported."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {id(node) for block in ast.walk(tree)
                   if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
                   for statement in block.body for node in ast.walk(statement)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out += [(alias.name, "", node.lineno) for alias in node.names if alias.name.split(".")[0] == "shadow"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "shadow":
                continue
            for alias in node.names:
                full = f"{source}.{alias.name}"
                out.append((full, "", node.lineno) if full in MODULES else (source, alias.name, node.lineno))
    return out


IMPORTS = {name: _imports(name, path) for name, path in MODULES.items()}


def _private_owner(module: str) -> str | None:
    """The package a module private by name belongs to (``shadow.modes.emulate._mode``: ``shadow.modes.emulate``)."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


def test_no_private_name_is_imported_from_another_module():
    found = set()
    for name, imports in IMPORTS.items():
        for module, imported, line in imports:
            if imported.startswith("_") and not imported.startswith("__"):
                found.add(f"{name}:{line} imports {imported} from {module}")
            owner = _private_owner(module)
            if owner is not None and not (name == owner or name.startswith(owner + ".")):
                found.add(f"{name}:{line} imports {module}, private to {owner}")
    assert not found, "make each public in its home, or move it:\n" + "\n".join(sorted(found))


def test_no_import_cycle():
    graph = {name: {m for m, _, _ in imports if m in MODULES and m != name} for name, imports in IMPORTS.items()}
    # Tarjan's strongly connected components: any of more than one module is a cycle
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                cycles.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, "modules that import each other (directly or around a cycle):\n" + "\n".join(map(str, cycles))


def _layer(module: str) -> int | None:
    for i, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch.fnmatchcase(module, p) for p in patterns):
            return i
    return None


def test_every_layer_names_modules_that_exist():
    for layer, patterns in LAYERS:
        for p in patterns:
            assert any(fnmatch.fnmatchcase(m, p) for m in MODULES), f"layer {layer!r}: no module {p}"


def test_the_results_side_imports_only_downwards():
    found = []
    for name, imports in IMPORTS.items():
        own = _layer(name)
        if own is None:
            continue
        for module, _, line in imports:
            other = _layer(module)
            if other is not None and other > own:
                found.append(f"{name}:{line} ({LAYERS[own][0]}) imports {module} ({LAYERS[other][0]})")
            if own < len(LAYERS) - 2 and any(fnmatch.fnmatchcase(module, p) for p in ENGINE_SIDE):
                found.append(f"{name}:{line} ({LAYERS[own][0]}) imports the engine side: {module}")
    assert not found, "\n".join(found)


def test_only_the_entry_points_import_the_cli():
    found = [f"{name}:{line} imports {module}" for name, imports in IMPORTS.items()
             if _layer(name) != len(LAYERS) - 1 and name != "shadow.__main__"
             for module, _, line in imports if module == "shadow.cli" or module.startswith("shadow.cli.")]
    assert not found, "\n".join(found)


def test_no_module_is_too_long():
    sizes = {name: len(path.read_text(encoding="utf-8").splitlines()) for name, path in MODULES.items()}
    over = [f"{name}: {n} lines" for name, n in sorted(sizes.items()) if n > MAX_LINES]
    assert not over, f"modules over {MAX_LINES} lines (split each along a real seam):\n" + "\n".join(over)


# torch's ModuleTracker keeps its module stack in private methods and attributes that change between releases:
# shadow tracks modules with hooks of its own (shadow.attribution.tracking.Tracker), through torch's public hooks
MODULE_TRACKER_PRIVATE = ("_get_append_fn", "_get_pop_fn", "_fw_pre_hook", "_fw_post_hook", "_get_mod_name",
                          "_known_modules", "_seen_modules", "_maybe_set_engine_callback", "_has_callback")


def test_no_private_name_of_torchs_module_tracker_is_used():
    found = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            used = node.attr if isinstance(node, ast.Attribute) else node.name if isinstance(node, ast.FunctionDef) \
                else node.id if isinstance(node, ast.Name) else node.value if isinstance(node, ast.Constant) else None
            if used in MODULE_TRACKER_PRIVATE:
                found.append(f"{name}:{node.lineno} {used}")
    assert not found, "use torch's public hooks, or shadow's Tracker:\n" + "\n".join(found)
