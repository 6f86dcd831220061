"""No module of llmopt takes part in an import cycle, directly or through a chain.

Checked on the source: every `import` / `from ... import` statement counts, at the top of a
module or inside a function (a lazy import only hides a cycle), relative ones and a
package's `__init__` re-exports included. `from llmopt.x import y` imports the module
`llmopt.x.y` when there is one, else `llmopt.x`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Package name -> its source folder. `kernels/` (installed as `llmopt.kernels`) imports nothing of llmopt
# outside itself (tests/test_layering.py), so no cycle through llmopt/ can pass through it.
SOURCES = {"llmopt": ROOT / "llmopt"}

# Cycles other changes of issue 24 are removing; empty this set once they are merged.


def module_files(sources: dict[str, Path]) -> dict[str, Path]:
    """Module name -> file, for every .py under each source folder (a package is its `__init__.py`)."""
    modules = {}
    for prefix, folder in sources.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if prefix == "llmopt" and parts[0] == "kernels":  # a working tree's link to kernels/, not llmopt/'s own
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((prefix, *parts))] = path
    return modules


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:`: imports for type hints, never executed."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return skipped


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The llmopt modules `name` (at `path`) imports, by any executed import statement anywhere in it
    (inside functions too; not those under `if TYPE_CHECKING:`)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    hints_only = _type_checking_only(tree)
    for node in ast.walk(tree):
        if id(node) in hints_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                submodule = f"{module}.{alias.name}"
                found.add(submodule if submodule in modules else module)
    return {m for m in found if m in modules and m != name}


def import_graph(sources: dict[str, Path]) -> dict[str, set[str]]:
    modules = module_files(sources)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.add(frozenset(component))
    return found


def test_no_import_cycles():
    found = cycles(import_graph(SOURCES))
    new = sorted(sorted(c) for c in found)
    assert new == [], f"modules importing each other (directly or through a chain): {new}"


def test_the_check_sees_cycles_through_lazy_and_relative_imports(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from .b import g\n")  # a re-export
    (package / "a.py").write_text("def f():\n    from pkg.sub import b\n")  # lazy
    (package / "sub" / "b.py").write_text("from .. import c\n\ndef g():\n    pass\n")  # relative
    (package / "c.py").write_text("import pkg.a\n")
    (package / "d.py").write_text("from pkg.sub import g\n")  # not a module: imports the package
    graph = import_graph({"pkg": package})
    assert graph["pkg.a"] == {"pkg.sub.b"}
    assert graph["pkg.sub"] == {"pkg.sub.b"}
    assert graph["pkg.d"] == {"pkg.sub"}
    assert cycles(graph) == {frozenset({"pkg.a", "pkg.sub.b", "pkg.c"})}
