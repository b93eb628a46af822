"""The package's import structure, read from the source with ``ast`` (nothing is imported): imports point
down the layers of docs/architecture.md."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "tinyformer"

#: ``python -m tinyformer`` is the command line's entry point, the one module above cli/.
ENTRY_POINTS = {"tinyformer.__main__"}


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(p, package): p for p in sorted(package.rglob("*.py"))}


def imported_names(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool) -> list[str]:
    """The absolute dotted names an import statement names: ``import a.b`` -> a.b; ``from a import b`` ->
    a.b (a module or a name in a); relative imports resolved against the importer."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = importer.split(".")
        anchor = anchor if is_package else anchor[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, *([base] if base else [])])
    return [f"{base}.{alias.name}" for alias in node.names]


def top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The imports that run when the module is imported: those in its body, class bodies, ``if`` and
    ``try`` blocks, not those inside functions (run later) nor under ``if TYPE_CHECKING:`` (never run)."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return found


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the tinyformer modules its top-level imports name (``from a import b``: a.b when that is a
    module, else a)."""
    mods = modules(package)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps = set()
        for node in top_level_imports(ast.parse(path.read_text(encoding="utf-8"))):
            for target in imported_names(node, name, path.name == "__init__.py"):
                while target and target not in mods:  # a name inside a module -> that module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    deps.add(target)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (a list of modules whose last imports the first), or None; depth-first search."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_top_level_import_graph_has_no_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join([*cycle, cycle[0]])


def test_cycle_finder_finds_a_cycle_and_accepts_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_imports_inside_functions_and_type_checking_blocks_are_not_top_level():
    tree = ast.parse("import a\nif TYPE_CHECKING:\n    import b\ndef f():\n    import c\n"
                     "class K:\n    import d\ntry:\n    import e\nexcept ImportError:\n    pass\n")
    assert sorted(n.names[0].name for n in top_level_imports(tree)) == ["a", "d", "e"]


def test_no_module_outside_cli_imports_cli():
    offenders = []
    for name, path in modules().items():
        if name == "tinyformer.cli" or name.startswith("tinyformer.cli.") or name in ENTRY_POINTS:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):  # imports inside functions count too
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in imported_names(node, name, path.name == "__init__.py"):
                    if target == "tinyformer.cli" or target.startswith("tinyformer.cli."):
                        offenders.append(f"{name} (line {node.lineno}) imports {target}")
    assert not offenders, "modules below the command line import it:\n" + "\n".join(offenders)


def test_the_walker_sees_a_nested_import_of_cli(tmp_path):
    tree = ast.parse("def f():\n    from tinyformer.cli.common import x\n")
    found = [t for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
             for t in imported_names(n, "tinyformer.training.train_config", False)]
    assert found == ["tinyformer.cli.common.x"]
