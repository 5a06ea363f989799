"""The package's shape, read from its source: the import graph between files is a DAG that
follows the layer order of docs/design.md (nothing imports upward), and each public name has
one home. Every import counts, also those inside functions. A module's length follows from
what it is for: none is set here."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "minisgl"

# Bottom to top. A file may import files of its own component or of a lower layer; components
# that share a layer never import each other.
LAYERS: list[set[str]] = [
    {"errors", "version"}, {"env"}, {"flag_checks"}, {"args"}, {"core", "stop_regex"},
    {"kvcache", "kernels", "distributed"},
    {"attention"}, {"layers"}, {"models"}, {"engine"}, {"grammar"}, {"scheduler"},
    {"runtime"},
    {"protocol"},
    {"server", "llm"},
    {"__main__", "__init__"},
    {"bench"},  # the benchmark tool: above everything, imported by nothing
]
# Imports the layer order allows but the design rules out: the front ends and the protocol reach
# the engine and the KV cache only through the runtime and the scheduler.
FORBIDDEN = {(front, low) for front in ("server", "llm", "protocol")
             for low in ("engine", "kvcache")}
# Of these components, others import only the package itself (what its __init__ exports).
FACADES = {"protocol": {"scheduler"}}
THIRD_PARTY_FORBIDDEN = {"scheduler": {"aiohttp"}, "engine": {"aiohttp"},
                         "protocol": {"aiohttp"}}


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
    assert not wrong, "imports against docs/design.md's layer order:\n" + "\n".join(sorted(wrong))


def test_facades_are_not_bypassed():
    wrong = [f"{name} imports {target}" for name, targets in graph().items()
             for target in targets
             if component(target) in FACADES.get(component(name), set())
             and target != f"minisgl.{component(target)}"]
    assert not wrong, "\n".join(sorted(wrong))


def test_third_party_imports_stay_in_their_layer():
    modules = files()
    wrong = [f"{name} imports {package}" for name, path in modules.items()
             for package in imports(path, modules)[1]
             if package in THIRD_PARTY_FORBIDDEN.get(component(name), set())]
    assert not wrong, "\n".join(wrong)


def test_each_public_name_has_one_home():
    """A module-level class or function not starting with `_` is defined in one file only:
    one concept, one place to read it (and to import it from). `main`, a command's entry
    point, is the one name each command module defines."""
    homes: dict[str, list[str]] = {}
    for name, path in files().items():
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                    and not node.name.startswith("_") and node.name != "main"):
                homes.setdefault(node.name, []).append(name)
    shared = {name: where for name, where in homes.items() if len(where) > 1}
    assert not shared, f"defined in several files: {shared}"


def test_server_parses_no_request_body():
    """Every body `read_json` returns goes straight into a function imported from
    minisgl.protocol: no handler in server/ reads a field of it."""
    wrong, seen = [], 0
    for name, path in files().items():
        if component(name) != "server":
            continue
        tree = ast.parse(path.read_text())
        from_protocol = {alias.asname or alias.name for node in ast.walk(tree)
                         if isinstance(node, ast.ImportFrom)
                         and (node.module or "").startswith("minisgl.protocol")
                         for alias in node.names}
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "read_json"):
                continue
            seen += 1
            read = parents[node]  # the Await around the call
            call = parents.get(read)
            if not (isinstance(read, ast.Await) and isinstance(call, ast.Call)
                    and read in call.args and getattr(call.func, "id", None) in from_protocol):
                wrong.append(f"{name}:{node.lineno}")
    assert seen and not wrong, "request bodies read outside minisgl.protocol: " + ", ".join(wrong)
