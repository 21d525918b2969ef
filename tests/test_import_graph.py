"""flashllm_ext has no import cycle. Its import graph is read from the source of every module: imports inside
functions count, imports under `if TYPE_CHECKING:` do not, and neither does a package's __init__.py importing its own
submodules (re-exports, not the data path). `from p.q import name` imports the module p.q.name where there is one,
else p.q. Any strongly connected component of more than one module is a cycle, named with the lines that close it."""

import ast
from collections import deque
from collections.abc import Iterable, Iterator
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Module name -> source file, for every Python module under `root`, the folder of `package`."""
    files = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join((package, *parts))] = path
    return files


def extension_modules(root: Path, package: str) -> set[str]:
    """Names of the compiled modules under `root` (they import nothing of the package's Python)."""
    names = set()
    for path in root.rglob("*"):
        suffix = next((s for s in EXTENSION_SUFFIXES if path.name.endswith(s)), None)
        if suffix:
            parts = path.relative_to(root).parts
            names.add(".".join((package, *parts[:-1], path.name.removesuffix(suffix))))
    return names


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_statements(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, at any depth, but those in the body of an `if TYPE_CHECKING:`."""
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _type_checking(node.test):
            pending.extend(node.orelse)
        else:
            pending.extend(ast.iter_child_nodes(node))


def _absolute(module: str, is_package: bool, target: str | None, level: int) -> str:
    """The absolute name of `from <level dots><target> import ...` written in `module`."""
    if level == 0:
        return target or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[: len(parts) - (level - 1)]
    return ".".join(parts + ([target] if target else []))


def import_graph(root: Path, package: str) -> dict[str, dict[str, int]]:
    """Module -> {module of the package it imports: line of the first such import}, for every module under `root`."""
    files = module_files(root, package)
    known = set(files) | extension_modules(root, package)
    graph = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        edges: dict[str, int] = {}
        for node in import_statements(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _absolute(module, is_package, node.module, node.level)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            for target in targets:
                if target not in files or target == module:
                    continue
                if is_package and target.startswith(module + "."):
                    continue  # the package re-exports its own submodule
                edges.setdefault(target, node.lineno)
        graph[module] = edges
    return graph


def strongly_connected(graph: dict[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of `graph` (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        work = [(start, iter(sorted(graph[start])))]
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph.get(successor, ())))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return sorted(components)


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The components of more than one module: each one's modules import one another in a cycle."""
    return [component for component in strongly_connected(graph) if len(component) > 1]


def one_cycle(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module: [m, ..., m]."""
    first, members = component[0], set(component)
    came_from: dict[str, str] = {}
    queue = deque([first])
    while queue:
        node = queue.popleft()
        for successor in sorted(graph[node]):
            if successor == first:
                path = [node]
                while path[-1] != first:
                    path.append(came_from[path[-1]])
                return [*reversed(path), first]
            if successor in members and successor not in came_from:
                came_from[successor] = node
                queue.append(successor)
    raise AssertionError(f"{component} is no cycle")


def describe(graph: dict[str, dict[str, int]], files: dict[str, Path], cycle: list[str]) -> str:
    steps = [f"  {files[a].relative_to(ROOT)}:{graph[a][b]} imports {b}" for a, b in zip(cycle, cycle[1:])]
    return " -> ".join(cycle) + "\n" + "\n".join(steps)


def test_flashllm_ext_has_no_import_cycle():
    root = ROOT / "flashllm_ext"
    files = module_files(root, "flashllm_ext")
    graph = import_graph(root, "flashllm_ext")
    assert len(graph) == len(list(root.rglob("*.py")))
    assert "flashllm_ext.errors" in graph["flashllm_ext.flash.store"]  # the graph is read, not empty
    cycles = import_cycles(graph)
    assert not cycles, "import cycles in flashllm_ext:\n" + "\n".join(
        describe(graph, files, one_cycle(graph, c)) for c in cycles
    )


def test_a_cycle_is_found_and_only_the_imports_that_count_are_edges(tmp_path):
    def write(files: dict[str, str | bytes]) -> dict[str, dict[str, int]]:
        for name, source in files.items():
            path = tmp_path / "pkg" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(source) if isinstance(source, bytes) else path.write_text(source)
        return import_graph(tmp_path / "pkg", "pkg")

    graph = write(
        {
            # re-exports of its own submodules: no edge (else pkg -> c -> pkg would be a cycle)
            "__init__.py": "VERSION = 1\nfrom . import a\nfrom .c import tool\nfrom pkg.sub import e\n",
            "a.py": "import os\nimport pkg.b\n",
            "b.py": "def late():\n    from pkg import a\n\n    return a\n",  # inside a function: an edge
            "c.py": "from typing import TYPE_CHECKING\n\nfrom pkg import VERSION\n\nif TYPE_CHECKING:\n"
            "    from pkg.d import D\nelse:\n    from .sub.e import E\n\n\ndef tool():\n    return None\n",
            "d.py": "from . import c\n",  # c's TYPE_CHECKING import is no edge, else c -> d -> c would be a cycle
            "sub/__init__.py": "",
            "sub/e.py": "from ..a import os\nfrom .. import sub\n",  # os is a name in pkg.a: the edge is to pkg.a
        }
    )
    assert {module: set(edges) for module, edges in graph.items()} == {
        "pkg": set(),
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.a"},
        "pkg.c": {"pkg", "pkg.sub.e"},
        "pkg.d": {"pkg.c"},
        "pkg.sub": set(),
        "pkg.sub.e": {"pkg.a", "pkg.sub"},
    }
    assert graph["pkg.b"]["pkg.a"] == 2
    assert import_cycles(graph) == [["pkg.a", "pkg.b"]]
    assert one_cycle(graph, ["pkg.a", "pkg.b"]) == ["pkg.a", "pkg.b", "pkg.a"]

    # A longer cycle, closed by a package's __init__.py importing a module outside it; a compiled module is no edge.
    graph = write(
        {
            "d.py": "from . import c\nfrom pkg import _native\n",
            f"_native{EXTENSION_SUFFIXES[0]}": b"",
            "sub/__init__.py": "from pkg import d\n",
        }
    )
    assert set(graph["pkg.d"]) == {"pkg.c"}
    cycles = import_cycles(graph)
    assert cycles == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d", "pkg.sub", "pkg.sub.e"]]
    assert one_cycle(graph, cycles[1]) == ["pkg.c", "pkg.sub.e", "pkg.sub", "pkg.d", "pkg.c"]
