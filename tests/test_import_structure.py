"""The package's import structure, read from the source with ``ast`` (nothing is imported): imports point
down the layers that docs/architecture.md writes down, and no import cycle joins two modules.

Every import counts, those inside functions too (they run, only later); an import under
``if TYPE_CHECKING:`` does not (it never runs). The layer order is parsed from the first code block under
"## The layers" in docs/architecture.md: one layer a line, top first, each naming folders (``training/``)
and top-level modules (``run_folder.py``) before its description. A module may import modules of its own
unit (folder or top-level module) and of the layers below it, nothing else.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "tinyformer"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

#: ``python -m tinyformer`` is the command line's entry point, the one module above cli/.
ENTRY_POINTS = {"tinyformer.__main__"}

#: Imports that break the layering or close a cycle today, (importer, imported module) -> why it is still
#: there and where it belongs. Each is to be moved and its line deleted; the test fails on a listed edge that
#: is gone (so the list only shrinks) and on any edge not listed.
ALLOWED: dict[tuple[str, str], str] = {}


# ---------------------------------------------------------------------------------------------- reading


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


def run_time_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import that can run: at module level, in class bodies, ``if`` and ``try`` blocks and inside
    functions; not those under ``if TYPE_CHECKING:`` (never run)."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return found


def import_edges(package: Path = PACKAGE) -> dict[tuple[str, str], int]:
    """(importer, imported tinyformer module) -> the line of the first such import (``from a import b``:
    a.b when that is a module, else a)."""
    mods = modules(package)
    edges: dict[tuple[str, str], int] = {}
    for name, path in mods.items():
        for node in run_time_imports(ast.parse(path.read_text(encoding="utf-8"))):
            for target in imported_names(node, name, path.name == "__init__.py"):
                while target and target not in mods:  # a name inside a module -> that module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    line = edges.get((name, target), node.lineno)
                    edges[(name, target)] = min(line, node.lineno)
    return edges


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules(package)}
    for importer, target in import_edges(package):
        graph[importer].add(target)
    return graph


def unit(module: str) -> str:
    """The folder (``training/``) or top-level module (``run_folder.py``) a module belongs to."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__.py"
    top = f"{parts[1]}/"
    return top if (PACKAGE / parts[1]).is_dir() else f"{parts[1]}.py"


UNIT = re.compile(r"[\w]+/|[\w]+\.py")


def parse_layers(markdown: str) -> list[list[str]]:
    """The units of each layer, top first, from the first code block under the "## The layers" heading: a
    line lists its units (``name/`` or ``name.py``) separated by spaces, then its description."""
    section = markdown.split("\n## The layers\n", 1)[1]
    block = section.split("```", 2)[1].split("\n", 1)[1]
    layers = []
    for line in block.splitlines():
        names = []
        for word in line.split():
            if not UNIT.fullmatch(word):
                break
            names.append(word)
        if names:
            layers.append(names)
    return layers


def layer_of(layers: list[list[str]]) -> dict[str, int]:
    """unit -> its layer's depth (0 is the top)."""
    return {name: depth for depth, names in enumerate(layers) for name in names}


def layer_violations(edges: dict[tuple[str, str], int], depth: dict[str, int]) -> dict[tuple[str, str], str]:
    """(importer, imported) -> a description, for every import of a unit that is not below the importer's."""
    out = {}
    for (importer, target), line in sorted(edges.items()):
        a, b = unit(importer), unit(target)
        if a != b and depth[b] <= depth[a]:
            where = "beside" if depth[a] == depth[b] else "above"
            out[(importer, target)] = f"{importer} (line {line}) imports {target}: {b} is {where} {a}"
    return out


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


@pytest.fixture(scope="module")
def edges() -> dict[tuple[str, str], int]:
    return import_edges()


@pytest.fixture(scope="module")
def layers() -> list[list[str]]:
    return parse_layers(ARCHITECTURE.read_text(encoding="utf-8"))


# ---------------------------------------------------------------------------------------------- the package


def test_no_import_cycle_between_modules_counting_imports_inside_functions(edges):
    graph: dict[str, set[str]] = {}
    for importer, target in edges:
        if (importer, target) not in ALLOWED:
            graph.setdefault(importer, set()).add(target)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join([*cycle, cycle[0]])


def test_every_folder_and_top_level_module_is_in_exactly_one_layer(layers):
    listed = [name for names in layers for name in names]
    units = sorted({unit(m) for m in modules()})
    assert sorted(set(listed)) == sorted(listed), f"listed twice: {sorted({n for n in listed if listed.count(n) > 1})}"
    assert sorted(listed) == units, (f"docs/architecture.md's layers lack {sorted(set(units) - set(listed))} and "
                                     f"name what is gone: {sorted(set(listed) - set(units))}")


def test_imports_point_down_the_layers_of_the_architecture_doc(edges, layers):
    violations = layer_violations(edges, layer_of(layers))
    new = [text for edge, text in violations.items() if edge not in ALLOWED]
    assert not new, "imports that point up or sideways (move the code down, or list the edge in ALLOWED):\n" + \
        "\n".join(new)


def test_the_folder_graph_has_no_cycle_apart_from_the_allowed_edges(edges):
    graph: dict[str, set[str]] = {}
    for importer, target in edges:
        a, b = unit(importer), unit(target)
        if a != b and (importer, target) not in ALLOWED:
            graph.setdefault(a, set()).add(b)
    cycle = find_cycle(graph)
    assert cycle is None, "cycle between folders: " + " -> ".join([*cycle, cycle[0]])


def reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    """Whether ``goal`` is imported, directly or through other modules, by ``start``."""
    seen, stack = set(), [start]
    while stack:
        node = stack.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            stack.extend(graph.get(node, ()))
    return False


def test_every_allowed_edge_still_exists_and_still_needs_allowing(edges, layers):
    """The allow-list only shrinks: an edge that was moved, or no longer points up nor closes a cycle, leaves it."""
    violations = layer_violations(edges, layer_of(layers))
    graph: dict[str, set[str]] = {}
    for importer, target in edges:
        graph.setdefault(importer, set()).add(target)
    stale = []
    for importer, target in ALLOWED:
        if (importer, target) not in edges:
            stale.append(f"{importer} no longer imports {target}")
        elif (importer, target) not in violations and not reaches(graph, target, importer):
            stale.append(f"{importer} -> {target} points down and closes no cycle")
    assert not stale, "delete from ALLOWED:\n" + "\n".join(stale)


def test_no_module_outside_cli_imports_cli(edges):
    offenders = [f"{importer} (line {line}) imports {target}" for (importer, target), line in sorted(edges.items())
                 if unit(target) == "cli/" and unit(importer) != "cli/" and importer not in ENTRY_POINTS]
    assert not offenders, "modules below the command line import it:\n" + "\n".join(offenders)


# ---------------------------------------------------------------------------------------------- the checker


def test_cycle_finder_finds_a_cycle_and_accepts_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_imports_inside_functions_count_and_type_checking_blocks_do_not():
    tree = ast.parse("import a\nif TYPE_CHECKING:\n    import b\nelse:\n    import f\ndef g():\n    import c\n"
                     "class K:\n    import d\ntry:\n    import e\nexcept ImportError:\n    pass\n")
    assert sorted(n.names[0].name for n in run_time_imports(tree)) == ["a", "c", "d", "e", "f"]


def test_the_walker_resolves_a_nested_relative_import():
    tree = ast.parse("def f():\n    from ..cli.common import x\n")
    found = [t for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
             for t in imported_names(n, "tinyformer.training.train_config", False)]
    assert found == ["tinyformer.cli.common.x"]


def test_layers_parse_units_up_to_the_description_and_skip_blank_lines():
    doc = "# A\n\n## The layers\n\n```\ncli/  top.py    the top\n\nmodels/   a model.py word\n```\n\n## B\n"
    assert parse_layers(doc) == [["cli/", "top.py"], ["models/"]]


def test_an_upward_and_a_sideways_import_are_violations_and_a_downward_one_is_not():
    depth = {"cli/": 0, "serve/": 1, "inspect/": 1, "models/": 2}
    edges = {("tinyformer.models.decoder", "tinyformer.cli.main"): 3,      # up
             ("tinyformer.serve.app", "tinyformer.inspect.plotting"): 4,    # beside
             ("tinyformer.cli.main", "tinyformer.models.decoder"): 5,       # down
             ("tinyformer.models.decoder", "tinyformer.models.encoder"): 6}  # own folder
    assert sorted(layer_violations(edges, depth)) == [("tinyformer.models.decoder", "tinyformer.cli.main"),
                                                      ("tinyformer.serve.app", "tinyformer.inspect.plotting")]
