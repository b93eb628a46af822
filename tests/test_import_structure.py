"""The package's import structure, read from the source with ``ast`` (nothing is imported): imports point
down the layers of docs/architecture.md."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "tinyformer"

#: ``python -m tinyformer`` is the command line's entry point, the one module above cli/.
ENTRY_POINTS = {"tinyformer.__main__"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


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
             for t in imported_names(n, "tinyformer.training.config", False)]
    assert found == ["tinyformer.cli.common.x"]
