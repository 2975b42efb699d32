"""The package's import graph, read from the source: imports run one way and never in a cycle.

Layers, lowest first (README "Layout of the code"):

   -1  errors, _version      what every layer may raise or print
    0  format                pure: the delta format, codec, digests, dtypes, strict JSON (no I/O)
    1  io                    shared I/O helpers: atomic files, fsync, the worker pool, digest cache
    2  checkpoints, delta    checkpoint readers; delta reading, writing, inspection
    3  produce, store, receive
    4  the Python API        dcr_cli/__init__.py, dcr_cli/api.py
    5  cli                   the click layer (and ``python -m dcr_cli`` above it)

A module may import from lower layers and from its own package; never from a higher layer, and never
from a sibling package of its own layer (produce, store and receive meet only in the API).
Function-level (lazy) imports count too: they are still dependencies.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "dcr_cli"

LAYERS = {
    "errors": -1,
    "_version": -1,
    "format": 0,
    "io": 1,
    "checkpoints": 2,
    "delta": 2,
    "produce": 3,
    "store": 3,
    "receive": 3,
    "": 4,  # dcr_cli/__init__.py
    "api": 4,
    "cli": 5,
    "__main__": 6,
}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """dcr_cli modules that ``name`` imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("dcr_cli"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("dcr_cli"):
                target = node.module
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
    return {m for m in found if m in modules and m != name}


def layer_of(name: str) -> tuple[str, int]:
    parts = name.split(".")
    package = parts[1] if len(parts) > 1 else ""
    if package not in LAYERS:
        raise AssertionError(f"{name}: package {package!r} has no layer; add it to LAYERS and the README")
    return package, LAYERS[package]


def graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_every_package_has_a_layer() -> None:
    for name in all_modules():
        layer_of(name)


def test_imports_run_downward() -> None:
    bad = []
    for name, deps in sorted(graph().items()):
        package, layer = layer_of(name)
        for dep in sorted(deps):
            dep_package, dep_layer = layer_of(dep)
            if dep_package == package:
                continue
            if dep_layer > layer or (dep_layer == layer and package != ""):
                bad.append(f"{name} (layer {layer}) imports {dep} (layer {dep_layer})")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_no_import_cycles() -> None:
    edges = graph()
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    cycles: list[list[str]] = []

    def visit(start: str) -> None:
        # iterative DFS: (node, iterator over its deps)
        stack = [(start, iter(sorted(edges[start])))]
        path = [start]
        state[start] = 1
        while stack:
            node, deps = stack[-1]
            for dep in deps:
                if state.get(dep) == 1:
                    cycles.append([*path[path.index(dep) :], dep])
                elif dep not in state:
                    state[dep] = 1
                    stack.append((dep, iter(sorted(edges[dep]))))
                    path.append(dep)
                    break
            else:
                state[node] = 2
                stack.pop()
                path.pop()

    for name in sorted(edges):
        if name not in state:
            visit(name)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from ..store import push\n", "dcr_cli.store"),
        ("def f():\n    from ..receive.checkpoint import read_state\n", "dcr_cli.receive.checkpoint"),
    ],
)
def test_checker_sees_relative_and_lazy_imports(tmp_path: Path, source: str, expected: str) -> None:
    # The checker itself must see what it polices: a relative import inside a function counts.
    fake = ROOT / "delta" / "_layer_probe.py"
    modules = {**all_modules(), "dcr_cli.delta._layer_probe": fake}
    tree_path = tmp_path / "probe.py"
    tree_path.write_text(source)
    found = imports_of("dcr_cli.delta._layer_probe", tree_path, modules)
    assert expected in found
