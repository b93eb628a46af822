"""How much tinyformer code a reader must follow: the lines and branches that one forward pass runs.

Traces (``sys.settrace``) the README's library example, ``DecoderLM(get_preset("tiny", vocab_size=256))``,
through two calls: a plain forward over a batch, and one cached decode step (one new token after a
prefill). For each call it reports

  * code lines: the lines of the tinyformer functions that ran, from ``def`` to their last line, docstrings,
    comments and blank lines left out (what a reader of those functions reads);
  * executed lines: those of them that ran (a statement spanning several lines counts every line of it);
  * branch statements: the ``if`` statements (``elif`` included) and conditional expressions ``a if c
    else b`` in the bodies of the tinyformer functions that ran, whether or not they were taken (a
    function nested inside another counts only when it ran itself);
  * the functions that ran and the files they are in.

    python benchmarks/trace_forward.py            # both calls, one table each
    python benchmarks/trace_forward.py --json     # the figures as JSON

tests/models/test_trace_forward.py keeps both calls within the bounds docs/architecture.md states.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import tokenize
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import CodeType, FrameType

import torch

import tinyformer

PACKAGE = Path(tinyformer.__file__).resolve().parent


@dataclass
class Trace:
    """What one traced call ran: (file, line) pairs and the code objects of the functions."""

    lines: set[tuple[str, int]] = field(default_factory=set)
    codes: set[CodeType] = field(default_factory=set)


@dataclass
class Figures:
    code_lines: int
    executed_lines: int
    branches: int
    functions: list[str]  # "file.py:function (branches)", in the order of the files
    files: list[str]


def _in_package(filename: str) -> bool:
    return Path(filename).resolve().is_relative_to(PACKAGE)


def run_traced(fn: Callable[[], object]) -> Trace:
    """Call ``fn`` under a tracer that records every tinyformer line and function that runs."""
    trace = Trace()
    seen: dict[str, bool] = {}

    def local(frame: FrameType, event: str, arg: object):
        if event == "line":
            trace.lines.add((frame.f_code.co_filename, frame.f_lineno))
        return local

    def tracer(frame: FrameType, event: str, arg: object):
        name = frame.f_code.co_filename
        if name not in seen:
            seen[name] = _in_package(name)
        if not seen[name]:
            return None
        trace.codes.add(frame.f_code)
        return local

    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(old)
    return trace


@cache
def _parsed(filename: str) -> tuple[ast.Module, frozenset[int], dict[int, tuple[int, int]]]:
    """The file's syntax tree, its lines that hold code, and for each line the span of its statement."""
    source = Path(filename).read_text(encoding="utf-8")
    tree = ast.parse(source)
    comment_only, blank = set(), set()
    for i, text in enumerate(source.splitlines(), start=1):
        if not text.strip():
            blank.add(i)
    with open(filename, "rb") as fh:
        for tok in tokenize.tokenize(fh.readline):
            if tok.type == tokenize.COMMENT and not tok.line[: tok.start[1]].strip():
                comment_only.add(tok.start[0])
    docstring_lines: set[int] = set()
    spans: dict[int, tuple[int, int]] = {}
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            docstring_lines.update(range(body[0].lineno, body[0].end_lineno + 1))
        if isinstance(node, ast.stmt):
            inner = [b for b in getattr(node, "body", []) if isinstance(b, ast.stmt)]
            last = inner[0].lineno - 1 if inner else node.end_lineno  # a compound statement: its header
            for line in range(node.lineno, last + 1):
                # the innermost statement wins: ast.walk visits outer statements first
                spans[line] = (node.lineno, last)
    code = frozenset(set(spans) - comment_only - blank - docstring_lines)
    return tree, code, spans


@cache
def _functions(filename: str) -> dict[int, ast.AST]:
    """Function definitions by the line their code object starts at (the first decorator's line)."""
    tree, _, _ = _parsed(filename)
    found: dict[int, ast.AST] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            found[first] = node
        elif isinstance(node, ast.Lambda):
            found.setdefault(node.lineno, node)
    return found


def count_branches(node: ast.AST) -> int:
    """``if`` statements and conditional expressions in a function's body, nested functions left out."""
    n = 0
    stack = list(ast.iter_child_nodes(node))
    while stack:
        child = stack.pop()
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        n += isinstance(child, (ast.If, ast.IfExp))
        stack.extend(ast.iter_child_nodes(child))
    return n


def figures(trace: Trace) -> Figures:
    lines: set[tuple[str, int]] = set()
    for filename, line in trace.lines:
        _, code, spans = _parsed(filename)
        first, last = spans.get(line, (line, line))
        lines.update((filename, i) for i in range(first, last + 1) if i in code)
    branches, code_lines, functions = 0, 0, []
    for co in sorted(trace.codes, key=lambda c: (c.co_filename, c.co_firstlineno)):
        node = _functions(co.co_filename).get(co.co_firstlineno)
        if node is None or (isinstance(node, ast.Lambda) and co.co_name != "<lambda>"):
            continue  # a comprehension or generator: its branches are its function's
        n = count_branches(node)
        branches += n
        _, code, _ = _parsed(co.co_filename)
        code_lines += sum(1 for i in range(node.lineno, node.end_lineno + 1) if i in code)
        rel = Path(co.co_filename).resolve().relative_to(PACKAGE)
        functions.append(f"{rel}:{co.co_qualname} ({n})")
    files = sorted({str(Path(f).resolve().relative_to(PACKAGE)) for f, _ in lines})
    return Figures(code_lines, len(lines), branches, functions, files)


def tiny_calls(batch: int = 2, prompt: int = 8) -> dict[str, Callable[[], object]]:
    """The two traced calls on the README's model: {"forward": ..., "decode_step": ...}, each ready to run
    (the decode step's prefill has been run already, outside the trace)."""
    from tinyformer.models.decoder import DecoderLM
    from tinyformer.presets import get_preset

    torch.manual_seed(0)
    model = DecoderLM(get_preset("tiny", vocab_size=256)).eval()
    x = torch.randint(0, 256, (batch, prompt))
    cache = model.new_cache(batch, prompt + 4)
    with torch.no_grad():
        model(x, cache=cache)
    step = torch.randint(0, 256, (batch, 1))

    def forward() -> object:
        with torch.no_grad():
            return model(x)

    def decode_step() -> object:
        with torch.no_grad():
            return model(step, cache=cache)

    return {"forward": forward, "decode_step": decode_step}


def measure(batch: int = 2, prompt: int = 8) -> dict[str, Figures]:
    return {name: figures(run_traced(call)) for name, call in tiny_calls(batch, prompt).items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--functions", action="store_true", help="list the functions that ran")
    args = parser.parse_args(argv)
    result = measure()
    if args.json:
        print(json.dumps({k: v.__dict__ for k, v in result.items()}, indent=2))
        return 0
    for name, fig in result.items():
        print(f"{name}: {fig.code_lines} code lines ({fig.executed_lines} executed), {fig.branches} branch statements, "
              f"{len(fig.functions)} functions in {len(fig.files)} files")
        if args.functions:
            for f in fig.functions:
                print(f"    {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
