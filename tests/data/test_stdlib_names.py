"""The one standard-library walker (data/stdlib_names.py) behind the built-in instruction set and the built-in
task: the sets it yields are those the two walkers it replaced yielded.

REGRESSION FIXTURE: the counts and SHA-256 digests in ``BEFORE`` were computed with the code as it was before
the walkers were merged (``data/instructions.py`` and ``evaluation/tasks.py`` each walking the standard
library themselves), on CPython 3.11.7, by hashing the JSON of every generated row (sorted keys) exactly as
:func:`rows` does here. They are not output of the code under test; they pin its output to the old code's.
The standard library differs between Python versions, so the digests are checked on that version only; the
counts of the issue that asked for the merge (11,717 questions, 100 task questions) are the same numbers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import pytest

from tinyformer.data.instructions import (
    builtin_conversations,
    builtin_preferences,
    documented_entries,
    heldout_questions,
)
from tinyformer.data.stdlib_names import public_module_name, public_modules
from tinyformer.evaluation.tasks import builtin_task

FIXTURE_PYTHON = (3, 11, 7)
BEFORE = {  # name: (rows, sha256 of their JSON), by the pre-merge walkers on CPython 3.11.7
    "conversations": (11717, "f9fcd266e0a438afe3ad5fb9c30f7ca5666946da3b9ce5941f7d982894feebfa"),
    "preferences": (2151, "1faa28b36977eec5d913e85837a8919c6f66607fd96f43c37c8ab975fe438936"),
    "heldout": (1143, "24d33261b7dbc6938412505f538a9751acf90f264abdbc4ede795a341aca9621"),
    "task": (100, "b4d2dacdc9295a495e72126d4b78f806e3349b2eb5d2832386357d464939b474"),
    "entries": (5405, "7f7571d63991060c59ae46e6116c88a46645ac5792032eb70b29c78621beca40"),
}


def rows() -> dict[str, list]:
    return {
        "conversations": [[c.messages, c.source] for c in builtin_conversations()],
        "preferences": [dataclasses.asdict(p) for p in builtin_preferences()],
        "heldout": heldout_questions(),
        "task": [dataclasses.asdict(t) for t in builtin_task()],
        "entries": [dataclasses.asdict(e) for e in documented_entries()],
    }


def digest(values: list) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()


@pytest.mark.skipif(sys.version_info[:3] != FIXTURE_PYTHON, reason="the fixture's digests are of CPython 3.11.7's "
                    "standard library")
def test_instruction_set_and_builtin_task_are_those_of_the_walkers_before_the_merge():
    got = {name: (len(values), digest(values)) for name, values in rows().items()}
    assert got == BEFORE


def test_public_module_names_drop_init_and_refuse_private_or_non_identifier_parts(tmp_path):
    root = tmp_path
    assert public_module_name(root / "urllib" / "parse.py", root) == "urllib.parse"
    assert public_module_name(root / "json" / "__init__.py", root) == "json"
    assert public_module_name(root / "_collections_abc.py", root) is None
    assert public_module_name(root / "email" / "_parseaddr.py", root) is None
    assert public_module_name(root / "not-a-name" / "x.py", root) is None
    assert public_module_name(root / "__init__.py", root) is None


def test_walker_parses_public_files_in_path_order_and_skips_what_does_not_parse(tmp_path):
    files = {"b.py": "class B: pass\n", "a/__init__.py": "x = 1\n", "_private.py": "y = 2\n",
             "broken.py": "def (:\n", "a/z.py": "def z(): pass\n"}
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    found = [(name, type(tree.body[0]).__name__) for name, tree in public_modules(Path(tmp_path))]
    assert found == [("a", "Assign"), ("a.z", "FunctionDef"), ("b", "ClassDef")]
