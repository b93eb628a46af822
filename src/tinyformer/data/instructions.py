"""The built-in instruction and preference sets, generated offline from the CPython documentation.

The same sources as the built-in corpus (:mod:`tinyformer.data.corpus`): the docstrings of the
standard library's ``.py`` files (read with ``ast``, nothing imported), plus the docstrings of the
built-in types and functions (``str.removeprefix``, ``len``), which live in C. Each documented public
function, class or method ``NAME`` gives an *entry* (qualified name, module, first sentence of its
docstring), and each entry gives questions:

    "What does `str.removeprefix` do?"   -> the first sentence of its docstring
    "Which module provides `urljoin`?"   -> "`urljoin` is provided by the `urllib.parse` module."
                                           (module-level names that only one module defines)

The first sentence is the docstring's first paragraph that is not a signature line, up to its first
". ", kept when it has 15-160 characters. Everything is sorted, so the set is the same on every run
of one Python version (thousands of pairs). The held-out split is the SFT/DPO one: a hash of the
question (``training/sft.is_heldout``).

The preference set pairs each question with its right answer (chosen) and a near miss (rejected):
for "What does" the first sentence of the next documented name of the same module (or of the next
module when it has one only), for "Which module" the next module in sorted order.
"""

from __future__ import annotations

import ast
import builtins
import functools
import inspect
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tinyformer.data.corpus import _stdlib_dir, stdlib_source_files

if TYPE_CHECKING:
    from tinyformer.data.chat_data import Conversation, PreferencePair

MIN_SENTENCE, MAX_SENTENCE = 15, 160
BUILTIN_TYPES = (str, bytes, bytearray, list, tuple, dict, set, frozenset, int, float, complex, range, memoryview)
_SIGNATURE = re.compile(r"^[\w.]+\(.*\)(\s*->.*)?$")


@dataclass(frozen=True)
class Entry:
    """A documented name: ``qualname`` as written in a question, its module (``builtins`` for the built-ins),
    its bare ``name``, whether it is defined at module level, and the first sentence of its docstring."""

    qualname: str
    module: str
    name: str
    top_level: bool
    sentence: str


def first_sentence(doc: str | None) -> str | None:
    """The first sentence of a docstring (see the module docstring), or None when there is no usable one."""
    if not doc:
        return None
    for paragraph in re.split(r"\n\s*\n", inspect.cleandoc(doc)):
        text = " ".join(paragraph.split())
        if not text or _SIGNATURE.match(text):
            continue
        cut = text.find(". ")
        sentence = text if cut < 0 else text[: cut + 1]
        if not sentence.endswith((".", "!", "?")):
            sentence += "."
        if MIN_SENTENCE <= len(sentence) <= MAX_SENTENCE and ">>>" not in sentence:
            return sentence
        return None
    return None


def _module_name(path: Path, root: Path) -> str | None:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if not parts or any(p.startswith("_") or not p.isidentifier() for p in parts):
        return None
    return ".".join(parts)


def _source_entries(path: Path, module: str) -> list[Entry]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(path.read_bytes(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return []
    out = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        sentence = first_sentence(ast.get_docstring(node, clean=False))
        if sentence:
            out.append(Entry(f"{module}.{node.name}", module, node.name, True, sentence))
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not item.name.startswith("_"):
                    sentence = first_sentence(ast.get_docstring(item, clean=False))
                    if sentence:
                        out.append(Entry(f"{module}.{node.name}.{item.name}", module, item.name, False, sentence))
    return out


def _builtin_entries() -> list[Entry]:
    out = []
    for name in sorted(dir(builtins)):
        obj = getattr(builtins, name)
        if name.startswith("_") or isinstance(obj, type) or not callable(obj):
            continue
        sentence = first_sentence(getattr(obj, "__doc__", None))
        if sentence:
            out.append(Entry(name, "builtins", name, True, sentence))
    for cls in BUILTIN_TYPES:
        for name in sorted(vars(cls)):
            if name.startswith("_"):
                continue
            sentence = first_sentence(getattr(getattr(cls, name), "__doc__", None))
            if sentence:
                out.append(Entry(f"{cls.__name__}.{name}", "builtins", name, False, sentence))
    return out


def documented_entries(stdlib_dir: str | Path | None = None) -> tuple[Entry, ...]:
    """Every entry, built-ins first, then the standard library (``stdlib_dir``, default this Python's) in
    sorted path order; each qualname once."""
    return _entries(Path(stdlib_dir).resolve() if stdlib_dir is not None else _stdlib_dir())


@functools.lru_cache(maxsize=2)
def _entries(root: Path) -> tuple[Entry, ...]:
    entries = _builtin_entries()
    for path in stdlib_source_files(root):
        module = _module_name(path, root)
        if module is not None:
            entries += _source_entries(path, module)
    seen: set[str] = set()
    unique = []
    for entry in entries:
        if entry.qualname not in seen:
            seen.add(entry.qualname)
            unique.append(entry)
    return tuple(unique)


def _module_answer(name: str, module: str) -> str:
    if module == "builtins":
        return f"`{name}` is a built-in: it needs no import."
    return f"`{name}` is provided by the `{module}` module."


def _questions(stdlib_dir: str | Path | None = None) -> tuple[tuple[str, str, str], ...]:
    """(question, right answer, near-miss answer) triples, in a fixed order."""
    entries = documented_entries(stdlib_dir)
    by_module: dict[str, list[Entry]] = {}
    for entry in entries:
        by_module.setdefault(entry.module, []).append(entry)
    modules = sorted(by_module)
    next_module = {m: modules[(i + 1) % len(modules)] for i, m in enumerate(modules)}
    top_names: dict[str, set[str]] = {}
    for entry in entries:
        if entry.top_level:
            top_names.setdefault(entry.name, set()).add(entry.module)
    out = []
    for entry in entries:
        siblings = [e for e in by_module[entry.module] if e.sentence != entry.sentence]
        if siblings:
            own = by_module[entry.module]
            i = own.index(entry)
            near = next(e for e in own[i + 1 :] + own[:i] if e.sentence != entry.sentence)
        else:
            near = by_module[next_module[entry.module]][0]
        if near.sentence != entry.sentence:
            out.append((f"What does `{entry.qualname}` do?", entry.sentence, near.sentence))
        if entry.top_level and len(top_names[entry.name]) == 1:
            out.append((f"Which module provides `{entry.name}`?", _module_answer(entry.name, entry.module),
                        _module_answer(entry.name, next_module[entry.module])))
    return tuple(out)


def builtin_conversations(stdlib_dir: str | Path | None = None) -> list[Conversation]:
    """The instruction set as conversations (user question, assistant answer)."""
    from tinyformer.data.chat_data import Conversation

    return [Conversation([{"role": "user", "content": q}, {"role": "assistant", "content": a}], f"built-in:{i}")
            for i, (q, a, _) in enumerate(_questions(stdlib_dir))]


def builtin_preferences(stdlib_dir: str | Path | None = None) -> list[PreferencePair]:
    """The preference set: each question with its right answer (chosen) and a near miss (rejected)."""
    from tinyformer.data.chat_data import PreferencePair

    return [PreferencePair([{"role": "user", "content": q}], a, near, f"built-in:{i}")
            for i, (q, a, near) in enumerate(_questions(stdlib_dir))]
