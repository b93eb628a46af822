"""The CPython standard library's public modules, read as source: the one walker behind the built-in
instruction set (:mod:`tinyformer.data.instructions`) and the built-in task (:mod:`tinyformer.evaluation.tasks`).

The files are those of the built-in corpus (:func:`~tinyformer.data.corpus.stdlib_source_files`, sorted by
path). A file is a public module when every part of its dotted name (``urllib/parse.py`` -> ``urllib.parse``,
``json/__init__.py`` -> ``json``) is an identifier that does not start with ``_``; each is parsed with
``ast`` (nothing is imported, warnings silenced), and a file that cannot be read or parsed is left out.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tinyformer.data.corpus import parse_source, stdlib_source_files


def public_module_name(path: Path, root: Path) -> str | None:
    """The dotted module name of the file ``path`` under ``root``, or None when it is not a public module."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if not parts or any(p.startswith("_") or not p.isidentifier() for p in parts):
        return None
    return ".".join(parts)


def public_modules(root: Path) -> Iterator[tuple[str, ast.Module]]:
    """(module name, parsed source) of every public module under ``root``, in sorted path order."""
    for path in stdlib_source_files(root):
        module = public_module_name(path, root)
        tree = None if module is None else parse_source(path)
        if module is not None and tree is not None:
            yield module, tree
