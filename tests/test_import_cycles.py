"""No import cycle between xeontune's modules (issue 18: job <-> launch, the autostop installer <->
the watcher, bench <-> cli; issue 31: the providers <-> the launch spec). Every import counts, also
one inside a function, under ``if __name__ == "__main__"`` or under ``if TYPE_CHECKING:``: a cycle
there still ties two modules into one (a type one layer names is a thing it depends on)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "xeontune"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports, anywhere in it."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            for alias in node.names:  # `from xeontune import launch` imports the module launch
                found.add(f"{base}.{alias.name}")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    # a module imports itself only through a package's __init__, which is not a cycle of its own
    return {m for m in found if m in modules and m != name and not name.startswith(m + ".")}


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, modules) for p in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    colour: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        colour[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if colour.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in colour:
                found = dfs(nxt)
                if found:
                    return found
        stack.pop()
        colour[node] = 2
        return None

    for node in sorted(graph):
        if node not in colour:
            found = dfs(node)
            if found:
                return found
    return None


def test_the_graph_sees_imports_inside_functions():
    graph = import_graph()
    assert "xeontune.errors" in graph["xeontune.cli"]
    assert "xeontune.cluster.manage" in graph["xeontune.cli"]  # imported inside a handler
    assert "xeontune.job.spec" in graph["xeontune.job.engines"]  # imported only for its types


def test_no_import_cycle_between_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
