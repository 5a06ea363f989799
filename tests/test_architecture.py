"""The package's shape, read from its source: the import graph between files is a DAG that
follows the layer order of DESIGN.md, and no file grows past the size one person reads in a
sitting. Every import counts, also those inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "minisgl"
MAX_LINES = 400

# Bottom to top. A file may import files of its own component or of a lower layer; components
# that share a layer never import each other.
LAYERS: list[set[str]] = [
    {"errors", "version"}, {"env"}, {"args"}, {"core", "stop_regex"},
    {"kvcache", "kernels", "distributed"},
    {"attention"}, {"layers"}, {"models"}, {"engine"}, {"grammar"}, {"scheduler"},
    {"runtime"},
    {"server", "llm"},
    {"__main__", "__init__"},
]
# Imports the layer order allows but the design rules out: the front ends reach the engine and
# the KV cache only through the runtime and the scheduler.
FORBIDDEN = {("server", "engine"), ("server", "kvcache"), ("llm", "engine"), ("llm", "kvcache")}
THIRD_PARTY_FORBIDDEN = {"scheduler": {"aiohttp"}, "engine": {"aiohttp"}}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def component(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def rank(comp: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if comp in layer)


def files() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path, modules: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(minisgl modules this file imports, top-level third-party packages it imports)."""
    ours, theirs = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] != "minisgl":
                theirs.add(name.split(".")[0])
            elif name in modules:  # `from pkg import sub` names a module; `from m import f` not
                ours.add(name)
    return ours, theirs


def graph() -> dict[str, set[str]]:
    modules = files()
    return {name: imports(path, modules)[0] - {name} for name, path in modules.items()}


def test_every_file_has_a_layer():
    for name in files():
        assert any(component(name) in layer for layer in LAYERS), f"{name}: no layer in LAYERS"


def test_no_import_cycle_between_files():
    edges = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)


def test_imports_point_down_the_layers():
    wrong = []
    for name, targets in graph().items():
        mine = component(name)
        for target in targets:
            theirs = component(target)
            if theirs == mine or (name == "minisgl" and target.startswith("minisgl.")):
                continue
            if rank(theirs) >= rank(mine) or (mine, theirs) in FORBIDDEN:
                wrong.append(f"{name} imports {target}")
    assert not wrong, "imports against DESIGN.md's layer order:\n" + "\n".join(sorted(wrong))


def test_third_party_imports_stay_in_their_layer():
    modules = files()
    wrong = [f"{name} imports {package}" for name, path in modules.items()
             for package in imports(path, modules)[1]
             if package in THIRD_PARTY_FORBIDDEN.get(component(name), set())]
    assert not wrong, "\n".join(wrong)


def test_no_file_is_too_long():
    long = {name: n for name, path in files().items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"
