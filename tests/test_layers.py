"""The host's packages are layered along the data flow (docs/architecture.md): a package
imports only packages below it, so nothing low depends on what is built on it, and no import
circle exists outside the simulators. Every import counts, including those inside functions
and under ``TYPE_CHECKING``."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set, Tuple

HOST = Path(__file__).resolve().parents[1] / "host"

#: Each top-level piece of ``host`` and its layer, lowest first.
LAYERS: Dict[str, int] = {
    "host": 0, "memory": 0, "core": 0,
    "sysfs": 1,
    "inventory": 2, "kubelet": 2,
    "metrics": 3,
    "config": 4,
    "dra": 5, "triggers": 5,
    "outputs": 6,
    "migration": 7,
    "app": 8,
    "sim": 9,
    "cli": 10,
    "process": 11,
    "__main__": 12,
}


def _piece(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "host"


def _modules() -> Dict[str, Path]:
    out = {}
    for path in HOST.rglob("*.py"):
        rel = path.relative_to(HOST.parent).with_suffix("")
        name = ".".join(rel.parts)
        out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def _imports(path: Path) -> List[Tuple[str, int]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module == "host":
                found += [(f"host.{alias.name}", node.lineno) for alias in node.names]
            elif node.module.startswith("host."):
                found.append((node.module, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names
                      if alias.name.startswith("host.")]
    return found


def test_every_piece_of_host_has_a_layer():
    pieces = {_piece(name) for name in _modules()}
    assert pieces <= set(LAYERS), sorted(pieces - set(LAYERS))


def test_no_package_imports_one_above_it_or_beside_it():
    wrong = []
    for name, path in sorted(_modules().items()):
        here = _piece(name)
        for target, line in _imports(path):
            there = _piece(target)
            if there == here or there not in LAYERS:
                continue
            if LAYERS[there] >= LAYERS[here]:
                wrong.append(f"{path.relative_to(HOST.parent)}:{line} ({here}) imports "
                             f"{target} ({there})")
    assert wrong == []


def test_no_import_circle_outside_the_simulators():
    modules = _modules()
    edges: Dict[str, Set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for target, _ in _imports(path):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and not target.startswith("host.sim"):
                edges[name].add(target)
    circles = []
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for name in sorted(edges):
        if name not in index and not name.startswith("host.sim"):
            visit(name)
    assert circles == []
