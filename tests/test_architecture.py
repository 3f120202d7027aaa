"""Import direction is the architecture (ARCHITECTURE.md): checked by parsing imports."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def _violations(package: str, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for path in sorted((ROOT / package.replace(".", "/")).rglob("*.py")):
        for module in _imports(path):
            if module.startswith(forbidden):
                bad.append(f"{path.relative_to(ROOT)} imports {module}")
    return bad


def test_helios_knows_no_model_architecture() -> None:
    assert _violations("helios", ("ignition",)) == []


def test_layers_import_downwards_only() -> None:
    layers = ["helios.server", "helios.protocols", "helios.frontend", "helios.engine"]
    for index, layer in enumerate(layers):
        if not (ROOT / layer.replace(".", "/")).exists():
            continue
        assert _violations(layer, tuple(layers[:index])) == [], f"{layer} imports a layer above it"
    assert _violations("helios.core", tuple(layers)) == []


def test_protocols_and_server_never_import_torch() -> None:
    for layer in ("helios.protocols", "helios.server"):
        if (ROOT / layer.replace(".", "/")).exists():
            assert _violations(layer, ("torch",)) == []


# Outside helios/engine, modules allowed to import engine submodules: path -> why. None today; an
# entry must stay needed (a stale one fails), so the list only shrinks.
FACE_EXCEPTIONS: dict[str, str] = {}


def test_only_the_engine_face_is_imported_from_outside_the_engine() -> None:
    """ARCHITECTURE.md, "The engine's face": the rest of helios imports only what `helios.engine`
    exports (its __all__), never a submodule; and engine modules import each other directly, never
    the face (which imports them all: that would be a cycle)."""
    face = ROOT / "helios/engine/__init__.py"
    exported = set()
    for node in ast.parse(face.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            exported = set(ast.literal_eval(node.value))
    assert exported, "helios/engine/__init__.py has no __all__"
    submodules = {
        p.stem for p in (ROOT / "helios/engine").iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()
    }
    reaching, in_engine, needed = [], [], set()
    for path in sorted((ROOT / "helios").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        inside = relative.startswith("helios/engine/")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [(alias.name, ()) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules = [(node.module, tuple(alias.name for alias in node.names))]
            else:
                continue
            for module, names in modules:
                if inside:
                    if module == "helios.engine" and path != face and set(names) - submodules:
                        in_engine.append(f"{relative} imports {sorted(set(names) - submodules)} from the face")
                    continue
                beyond = module.startswith("helios.engine.") or (module == "helios.engine" and set(names) - exported)
                if beyond and relative in FACE_EXCEPTIONS:
                    needed.add(relative)
                elif beyond:
                    reaching.append(f"{relative} imports {module} {sorted(set(names) - exported)}")
    assert reaching == [], "import these from helios.engine (add the name to its __all__ if it must cross)"
    assert in_engine == [], "engine modules import the submodule that defines a name, not the face"
    assert set(FACE_EXCEPTIONS) == needed, (
        f"no longer needed, remove from FACE_EXCEPTIONS: {set(FACE_EXCEPTIONS) - needed}"
    )


def _helios_modules() -> dict[str, Path]:
    """Every helios module by dotted name (a package by its __init__.py)."""
    modules = {}
    for path in sorted((ROOT / "helios").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of a module, wherever they sit (functions included), except those
    under `if TYPE_CHECKING:` (never executed)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in {
            getattr(node.test, "id", None),
            getattr(node.test, "attr", None),
        }:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _import_graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {helios module it imports: line of the first such import}. `from pkg import name`
    counts as an import of pkg.name where that is a module (a submodule), else of pkg. Importing
    a.b.c also runs the __init__ of a and a.b, but those are not counted: a package's __init__
    that imports its own children would otherwise always close a loop."""
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
                ]
            for target in targets:
                if target in modules and target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def _strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def _a_cycle(graph: dict[str, dict[str, int]], component: list[str], modules: dict[str, Path]) -> str:
    """One loop through the component's first module, each step with the line that imports."""
    members, start = set(component), component[0]
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier and start not in came_from:  # breadth first: the shortest way back to start
        following = []
        for node in frontier:
            for child in graph[node]:
                if child in members and child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    path = [start]
    while len(path) == 1 or path[-1] != start:
        path.append(came_from[path[-1]])
    path.reverse()
    steps = [f"{a} -> {b} ({modules[a].relative_to(ROOT)}:{graph[a][b]})" for a, b in zip(path, path[1:])]
    return "\n    ".join(steps)


def test_no_import_cycles_among_helios_modules() -> None:
    """No two helios modules need each other, directly or around a loop (imports inside functions
    count too: they only defer the loop). Where two modules need each other, move what both use
    into a module of its own, or let a package's __init__ import its parts instead of the parts
    importing the package."""
    modules = _helios_modules()
    graph = _import_graph(modules)
    cycles = [component for component in _strongly_connected(graph) if len(component) > 1]
    report = [
        f"{len(component)} modules import each other: {', '.join(component)}\n    {_a_cycle(graph, component, modules)}"
        for component in cycles
    ]
    assert not report, "import cycles among helios modules:\n" + "\n".join(report)
