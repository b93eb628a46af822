"""Text corpora: the built-in one every CPython install carries, and user files, folders and globs.

A corpus is handled as a sequence of *documents* (a file, a JSONL record, a docstring).
:func:`load_corpus` joins them with a blank line into one string; :func:`iter_documents` yields
them one at a time so that large corpora can be encoded without holding all the text at once.
"""

from __future__ import annotations

import ast
import functools
import gc
import glob
import json
import os
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tinyformer.errors import DataError

#: Separator between documents when a corpus is returned as one string.
DOC_SEPARATOR = "\n\n"

#: File suffixes read when a corpus path is a folder.
TEXT_SUFFIXES = (".txt", ".md")

# Folders of the standard library whose docstrings are not prose about Python (test suites) or
# are not the standard library at all (third-party packages).
_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "lib2to3", "site-packages", "dist-packages", "__pycache__",
                        "pydoc_data"})
_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def stdlib_root(stdlib_dir: str | os.PathLike[str] | None = None) -> Path:
    """``stdlib_dir`` resolved, or this Python's standard library folder."""
    return Path(stdlib_dir).resolve() if stdlib_dir is not None else Path(sysconfig.get_paths()["stdlib"])


def stdlib_source_files(stdlib_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """List the standard library ``.py`` files whose docstrings go into :func:`builtin_corpus`.

    Test suites, ``lib2to3``, ``pydoc_data`` (read separately) and installed packages are skipped.
    The list is sorted by path relative to ``stdlib_dir`` so the corpus is the same on every run.
    """
    root = Path(stdlib_dir) if stdlib_dir is not None else stdlib_root()
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        found.extend(Path(dirpath, name) for name in filenames if name.endswith(".py"))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def parse_source(path: Path) -> ast.Module | None:
    """A Python file parsed with ``ast`` (nothing imported), or None when it cannot be read or parsed."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. SyntaxWarning for old escape sequences on newer Pythons
            return ast.parse(path.read_bytes(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return None


def _pydoc_topics(stdlib_dir: Path) -> list[str]:
    """The help texts of ``pydoc_data/topics.py`` (the ``topics`` dict values), in file order."""
    tree = parse_source(stdlib_dir / "pydoc_data" / "topics.py")
    for node in tree.body if tree is not None else []:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        value = getattr(node, "value", None)
        if any(isinstance(t, ast.Name) and t.id == "topics" for t in targets) and isinstance(value, ast.Dict):
            return [v.value.strip() for v in value.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    return []


def _docstrings(path: Path) -> list[str]:
    """Module, class and function docstrings of one source file; [] if it cannot be parsed."""
    tree = parse_source(path)
    docs: list[str] = []
    stack: list[ast.AST] = [tree] if tree is not None else []
    while stack:
        node = stack.pop()
        if isinstance(node, _DOC_NODES):
            doc = ast.get_docstring(node)
            if doc and doc.strip():
                docs.append(doc.strip())
        # Docstrings only live on statements, so expressions (most of the tree) are never visited.
        children = [c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)]
        stack.extend(reversed(children))  # reversed: pop in source order
    return docs


@functools.lru_cache(maxsize=4)
def _builtin_corpus(stdlib_dir: Path) -> str:
    # Parsing ~700 files allocates millions of AST nodes, which triggers the cyclic garbage collector
    # over and over (2x the run time in a process holding torch). AST trees have no reference cycles,
    # so reference counting frees them and the collector can safely pause meanwhile.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        docs = _pydoc_topics(stdlib_dir)
        for path in stdlib_source_files(stdlib_dir):
            docs.extend(_docstrings(path))
    finally:
        if was_enabled:
            gc.enable()
    if not docs:
        raise DataError(f"no built-in corpus: found neither {stdlib_dir / 'pydoc_data' / 'topics.py'} nor "
                        f"standard library .py sources under {stdlib_dir}; pass a corpus path (a .txt/.md/.jsonl file "
                        "or folder)")
    return DOC_SEPARATOR.join(docs)


def builtin_corpus(stdlib_dir: str | os.PathLike[str] | None = None) -> str:
    """English prose that ships with CPython, read without importing any module.

    The ``pydoc_data/topics.py`` help texts (the language reference sections ``help()`` shows),
    followed by the module/class/function docstrings of the standard library sources, in sorted
    path order, separated by blank lines: about 2 M characters on CPython 3.11. Parts that are
    missing (e.g. an install without ``.py`` sources) are skipped; if nothing is found a
    :class:`DataError` is raised. The result is memoised in memory for the process, never on disk.
    """
    return _builtin_corpus(stdlib_root(stdlib_dir).resolve())


def iter_corpus_files(path: str | os.PathLike[str]) -> list[Path]:
    """Resolve a corpus path to the files it names, in sorted order.

    A file is returned as is; a folder gives all its ``.txt``/``.md`` files, recursively; a glob
    pattern (``*``, ``?``, ``[``; ``**`` recurses) gives the files it matches; the name of a data set in
    :data:`~tinyformer.data.named.NAMED_DATASETS` (``tinyshakespeare``) gives its cached, checked file.
    """
    from tinyformer.data.named import NAMED_DATASETS, fetch_named

    text = os.fspath(path)
    p = Path(text).expanduser()
    if p.is_file():
        return [p]
    if text in NAMED_DATASETS and not p.exists():  # e.g. --data tinyshakespeare (data/named.py)
        return [fetch_named(text)]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise DataError(f"corpus folder {p} has no .txt or .md files; put text files in it or name a file")
        return files
    if any(ch in text for ch in "*?["):  # a glob pattern
        files = sorted(Path(f) for f in glob.glob(os.path.expanduser(text), recursive=True) if os.path.isfile(f))
        if not files:
            raise DataError(f"corpus pattern {text!r} matches no files")
        return files
    raise DataError(f"corpus path {text} does not exist; give a text/.jsonl file, a folder, a glob pattern or a "
                    f"named data set ({', '.join(NAMED_DATASETS)})")


def read_text(path: Path, what: str = "corpus file") -> str:
    """Read a UTF-8 text file (a leading byte-order mark is dropped), with a useful decode error naming
    the file as ``what``."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {what} {path}: {e.strerror or e}") from e
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{what} {path} is not UTF-8: byte 0x{data[e.start]:02x} at byte offset {e.start} "
                        f"({e.reason}); re-encode it to UTF-8, e.g. `iconv -f latin1 -t utf-8 {path.name} > "
                        "out.txt`") from e
    return text.removeprefix("\ufeff")


def jsonl_rows(path: Path, what: str, hint: str = "") -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON) of every non-blank line of a JSONL file (read as ``what``, see
    :func:`read_text`); a line that is not JSON is a DataError naming it, followed by ``hint``."""
    for lineno, line in enumerate(read_text(path, what).splitlines(), start=1):
        if line.strip():
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg}){hint}") from None


def _jsonl_documents(path: Path, text_field: str) -> Iterator[str]:
    hint = f'; each line must be one object like {{"{text_field}": "..."}}'
    for lineno, record in jsonl_rows(path, "corpus file", hint):
        if not isinstance(record, dict) or text_field not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise DataError(f"{path}:{lineno}: no field {text_field!r} (found {keys}); set the text field to one "
                            "that holds the text")
        value = record[text_field]
        if not isinstance(value, str):
            raise DataError(f"{path}:{lineno}: field {text_field!r} is {type(value).__name__}, expected a string")
        yield value


def iter_documents(path: str | os.PathLike[str], text_field: str = "text") -> Iterator[str]:
    """Yield a corpus path's documents: one per ``.jsonl`` line (its ``text_field``), else one per file."""
    for file in iter_corpus_files(path):
        if file.suffix.lower() == ".jsonl":
            yield from _jsonl_documents(file, text_field)
        else:
            yield read_text(file)


def _load_hf(name: str, text_field: str) -> str:
    """Load the ``train`` split of a Hugging Face dataset (needs the optional ``datasets`` package)."""
    try:
        import datasets  # lazy: optional and slow to import
    except ImportError as e:
        raise DataError(f"corpus 'hf:{name}' needs the `datasets` package; install it (pip install datasets) or "
                        "download the data to a .jsonl/.txt file") from e
    try:
        ds = datasets.load_dataset(name, split="train")
    except Exception as e:  # the datasets library raises many unrelated types
        raise DataError(f"cannot load Hugging Face dataset {name!r}: {e}") from e
    if text_field not in ds.column_names:
        raise DataError(f"dataset {name!r} has no column {text_field!r} (columns: {ds.column_names})")
    return DOC_SEPARATOR.join(str(t) for t in ds[text_field])


def load_corpus(path: str | os.PathLike[str] | None, text_field: str = "text") -> str:
    """Load a corpus as one string, documents separated by a blank line.

    ``None`` gives :func:`builtin_corpus`; ``"hf:NAME"`` a Hugging Face dataset (optional
    ``datasets`` package); otherwise a file, folder or glob as in :func:`iter_corpus_files`, where
    ``.jsonl`` files contribute the ``text_field`` of each line.
    """
    if path is None:
        return builtin_corpus()
    where = os.fspath(path)
    if where.startswith("hf:"):
        text = _load_hf(where[3:], text_field)
    else:
        text = DOC_SEPARATOR.join(iter_documents(where, text_field))
    if not text.strip():
        raise DataError(f"corpus {where} is empty (no non-whitespace text)")
    return text
