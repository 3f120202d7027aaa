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
