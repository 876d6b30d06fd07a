"""The size of each room in ``src/gpupool``: the figures ``docs/architecture.md`` gives.

Run from the repository root (``python bench/rooms.py [SRC]``); it reads the source with
:mod:`ast` and imports nothing of gpupool. It prints the largest files, the classes past
the house limits (~25 methods, ~15 fields, ~500 lines), the longest functions, the import
cycles (at run time, and through ``if TYPE_CHECKING:`` imports), and which members of the
planner the code outside the core uses.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

METHODS_LIMIT = 25
FIELDS_LIMIT = 15
CLASS_LINES_LIMIT = 500
FUNCTION_LINES_LIMIT = 60


def _modules(src: Path) -> dict[str, Path]:
    package = src / "gpupool"
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _fields(node: ast.ClassDef) -> set[str]:
    """A class's fields: annotated class-level names and every ``self.X = ...`` store."""
    fields = {
        s.target.id
        for s in node.body
        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
    }
    for sub in ast.walk(node):
        if (
            isinstance(sub, ast.Attribute)
            and isinstance(sub.ctx, ast.Store)
            and isinstance(sub.value, ast.Name)
            and sub.value.id == "self"
        ):
            fields.add(sub.attr)
    return fields


def classes(modules: dict[str, Path]) -> list[tuple[str, int, int, int]]:
    """``(name, lines, methods, fields)`` for every class."""
    rows = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                methods = [b for b in node.body if isinstance(b, ast.FunctionDef)]
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                rows.append((f"{name}.{node.name}", lines, len(methods), len(_fields(node))))
    return rows


def functions(modules: dict[str, Path]) -> list[tuple[str, int]]:
    """``(name, lines)`` for every function and method."""
    rows = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                rows.append((f"{name}.{node.name}", lines))
    return rows


def _imports(tree: ast.Module, module: str, known: set[str]) -> Iterator[tuple[str, str]]:
    """``(imported module, "runtime" | "typing")`` for each gpupool import in ``tree``."""
    typing_nodes: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_nodes.update(id(sub) for sub in ast.walk(node))
    # A package's relative imports resolve against itself, a module's against its parent.
    package = module if _is_package(module, known) else module.rpartition(".")[0]
    for node in ast.walk(tree):
        kind = "typing" if id(node) in typing_nodes else "runtime"
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != module:
                yield target, kind
                break


def _is_package(module: str, known: set[str]) -> bool:
    return any(other.startswith(module + ".") for other in known)


def cycles(modules: dict[str, Path], kinds: tuple[str, ...]) -> list[list[str]]:
    """The strongly connected groups of two or more modules, over imports of ``kinds``."""
    known = set(modules)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for target, kind in _imports(ast.parse(path.read_text(encoding="utf-8")), name, known):
            if kind in kinds and not name.startswith(target + "."):  # a package's own parent
                graph[name].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(10_000)
    for name in graph:
        if name not in index:
            visit(name)
    return sorted(found)


def planner_members(modules: dict[str, Path]) -> set[str]:
    """The planner members read outside ``gpupool._core`` (``planner.X``, ``self.planner.X``)."""
    used = set()
    for name, path in modules.items():
        if name.startswith("gpupool._core"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute):
                owner = node.value
                if (isinstance(owner, ast.Name) and owner.id == "planner") or (
                    isinstance(owner, ast.Attribute) and owner.attr == "planner"
                ):
                    used.add(node.attr)
    return used


def main(src: Path) -> None:
    modules = _modules(src)
    total = sum(len(p.read_text(encoding="utf-8").splitlines()) for p in modules.values())
    print(f"src: {total} lines in {len(modules)} modules")
    print("\nlargest modules (lines):")
    sizes = sorted(
        ((len(p.read_text(encoding="utf-8").splitlines()), n) for n, p in modules.items()),
        reverse=True,
    )
    for lines, name in sizes[:8]:
        print(f"  {lines:6d}  {name}")
    print(
        f"\nclasses past ~{METHODS_LIMIT} methods, ~{FIELDS_LIMIT} fields or "
        f"~{CLASS_LINES_LIMIT} lines (lines, methods, fields):"
    )
    for name, lines, methods, fields in sorted(classes(modules), key=lambda r: -r[1]):
        if methods > METHODS_LIMIT or fields > FIELDS_LIMIT or lines > CLASS_LINES_LIMIT:
            print(f"  {lines:6d} {methods:4d} {fields:4d}  {name}")
    print(f"\nfunctions past ~{FUNCTION_LINES_LIMIT} lines:")
    for name, lines in sorted(functions(modules), key=lambda r: -r[1]):
        if lines > FUNCTION_LINES_LIMIT:
            print(f"  {lines:6d}  {name}")
    for label, kinds in (("at run time", ("runtime",)), ("with typing", ("runtime", "typing"))):
        found = cycles(modules, kinds)
        print(f"\nimport cycles {label}: {len(found)}")
        for group in found:
            print("  " + " <-> ".join(group))
    used = sorted(planner_members(modules))
    print(f"\nplanner members used outside the core: {len(used)}")
    print("  " + " ".join(used))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("src"))
