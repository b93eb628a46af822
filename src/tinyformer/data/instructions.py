"""The built-in instruction and preference sets, generated offline from the CPython standard library.

The same sources as the built-in corpus (:mod:`tinyformer.data.corpus`): the standard library's
``.py`` files (read with ``ast``, nothing imported) and the built-in types (``str.removeprefix``),
which live in C. Each documented public function, class or method gives an *entry* (qualified name,
module, bare name; "documented": its docstring has a usable first sentence, see :func:`first_sentence`),
and each entry gives instructions whose answer follows from the question itself:

    "Write the import statement for `urllib.parse.urljoin`."   -> "`from urllib.parse import urljoin`"
    "Which module is `urllib.parse.urljoin` defined in?"       -> "`urllib.parse`"
    "After `import urllib.parse`, how do you refer to `urljoin`?" -> "`urllib.parse.urljoin`"
    "Which class is `json.decoder.JSONDecoder.decode` a method of?" -> "`JSONDecoder`"

    "Is `urllib.parse.urljoin` a class or a function?"          -> "A function."

(the import, module and reference questions for module-level names, the class for methods, the kind for
module-level names and the built-in functions). A small model can learn these from a
few thousand examples and answer the held-out ones, where questions that need knowledge of the
library ("what does `urljoin` do?") are beyond a model of a few million parameters trained on a few
million tokens: the set is meant to show, in minutes on a CPU, that SFT teaches a model to follow an
instruction and DPO to prefer the better answer. Everything is sorted, so the set is the same on
every run of one Python version (about ten thousand questions on CPython 3.11). The held-out split is
the SFT/DPO one: a hash of the question (``data/chat_data.is_heldout``); ``tinyformer eval --task
instructions`` scores a model's exact answers on it (:func:`heldout_questions`).

The preference set takes one question per module-level name (the names take the four kinds of
question in turn; about two thousand pairs, so that the reference pass of DPO stays short) and pairs
it with its right answer (chosen) and the answer to a nearby question about the same name (rejected):
`import MODULE` for the import statement (it runs, but does not bind the name), the full dotted name
for its module, the bare name for how to refer to it after ``import MODULE``, the other kind for the
kind. The pairs differ in form, not in a fact the model would have to know, so a small model can learn
the preference and carry it over to held-out names.
"""

from __future__ import annotations

import ast
import builtins
import functools
import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tinyformer.data.corpus import stdlib_root
from tinyformer.data.stdlib_names import public_modules

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
    is_class: bool = False


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


def _is_property(decorator: ast.expr) -> bool:
    """``@property``, ``@functools.cached_property``, ``@x.setter``: an attribute, not a method."""
    name = decorator.attr if isinstance(decorator, ast.Attribute) else getattr(decorator, "id", "")
    return name in ("property", "cached_property", "setter", "getter", "deleter")


def _source_entries(tree: ast.Module, module: str) -> list[Entry]:
    out = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        sentence = first_sentence(ast.get_docstring(node, clean=False))
        if sentence:
            is_class = isinstance(node, ast.ClassDef)
            out.append(Entry(f"{module}.{node.name}", module, node.name, True, sentence, is_class))
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if (isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not item.name.startswith("_")
                        and not any(_is_property(d) for d in item.decorator_list)):
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
            attr = getattr(cls, name)
            sentence = first_sentence(getattr(attr, "__doc__", None))
            if sentence and callable(attr):  # methods, not data descriptors such as `int.denominator`
                out.append(Entry(f"{cls.__name__}.{name}", "builtins", name, False, sentence))
    return out


def documented_entries(stdlib_dir: str | Path | None = None) -> tuple[Entry, ...]:
    """Every entry, built-ins first, then the standard library (``stdlib_dir``, default this Python's) in
    sorted path order; each qualname once."""
    return _entries(stdlib_root(stdlib_dir))


@functools.lru_cache(maxsize=2)
def _entries(root: Path) -> tuple[Entry, ...]:
    entries = _builtin_entries()
    for module, tree in public_modules(root):
        entries += _source_entries(tree, module)
    first: dict[str, Entry] = {}  # each qualname's first entry, in the order of first appearance
    for entry in entries:
        first.setdefault(entry.qualname, entry)
    return tuple(first.values())


def _questions(stdlib_dir: str | Path | None = None) -> tuple[tuple[str, str, str, int], ...]:
    """(question, right answer, near-miss answer, entry number) in a fixed order (see the module docstring);
    the entry number is that of a module-level entry, -1 for a method's question."""
    entries = documented_entries(stdlib_dir)
    out = []
    for number, entry in enumerate(entries):
        if not entry.top_level:
            owner = entry.qualname[: -len(entry.name) - 1]
            cls = owner.rsplit(".", 1)[-1]
            wrong = entry.module if entry.module != "builtins" else entry.name
            out.append((f"Which class is `{entry.qualname}` a method of?", f"`{cls}`", f"`{wrong}`", -1))
            continue
        kind, other = ("A class.", "A function.") if entry.is_class else ("A function.", "A class.")
        out.append((f"Is `{entry.qualname}` a class or a function?", kind, other, number))
        if entry.module == "builtins":
            continue  # `len`: nothing to import, no module to name
        module, name = entry.module, entry.name
        out.append((f"Write the import statement for `{module}.{name}`.", f"`from {module} import {name}`",
                    f"`import {module}`", number))
        out.append((f"Which module is `{module}.{name}` defined in?", f"`{module}`", f"`{module}.{name}`", number))
        out.append((f"After `import {module}`, how do you refer to `{name}`?", f"`{module}.{name}`", f"`{name}`",
                    number))
    return tuple(out)


def heldout_questions(fraction: float = 0.1, stdlib_dir: str | Path | None = None) -> list[tuple[str, str]]:
    """(question, right answer) of the held-out split (``fraction`` as ``--val-fraction``) of the instruction set."""
    from tinyformer.data.chat_data import is_heldout

    return [(q, a) for q, a, _, _ in _questions(stdlib_dir) if is_heldout(q, fraction)]


def builtin_conversations(stdlib_dir: str | Path | None = None) -> list[Conversation]:
    """The instruction set as conversations (user question, assistant answer)."""
    from tinyformer.data.chat_data import Conversation

    return [Conversation([{"role": "user", "content": q}, {"role": "assistant", "content": a}], f"built-in:{i}")
            for i, (q, a, _, _) in enumerate(_questions(stdlib_dir))]


def builtin_preferences(stdlib_dir: str | Path | None = None) -> list[PreferencePair]:
    """The preference set: one question per module-level entry (the entries take the kinds of question in
    turn), its right answer chosen and its near miss rejected."""
    from tinyformer.data.chat_data import PreferencePair

    by_entry: dict[int, list[tuple[str, str, str]]] = {}
    for q, a, near, number in _questions(stdlib_dir):
        if number >= 0:
            by_entry.setdefault(number, []).append((q, a, near))
    picked = [options[number % len(options)] for number, options in sorted(by_entry.items())]
    return [PreferencePair([{"role": "user", "content": q}], a, near, f"built-in:{i}")
            for i, (q, a, near) in enumerate(picked)]


#: the kind of each built-in question, by the start of its text
QUESTION_KINDS = (("Write the import statement for ", "import"), ("Which module is ", "module"),
                  ("After `import ", "reference"), ("Which class is ", "method"), ("Is `", "kind"))


def builtin_prompts(stdlib_dir: str | Path | None = None) -> list[dict]:
    """The instruction set as prompt rows for ``--objective grpo``: ``{"messages": [user question], "answer":
    the right answer, "kind": import | module | reference | method | kind}``, and for the import-statement
    questions ``"module"`` and ``"name"`` (what ``builtin:python-import`` checks the statement binds)."""
    rows = []
    for q, a, _, _ in _questions(stdlib_dir):
        kind = next(k for start, k in QUESTION_KINDS if q.startswith(start))
        row: dict = {"messages": [{"role": "user", "content": q}], "answer": a, "kind": kind}
        if kind == "import":
            module, _, name = q[len("Write the import statement for `"):-2].rpartition(".")
            row.update(module=module, name=name)
        rows.append(row)
    return rows
