"""The learner's path stays short: benchmarks/trace_forward.py counts the tinyformer code lines and branch
statements of the functions that one forward of the README's model runs (docs/architecture.md gives the
figures), and this keeps the plain forward and one cached decode step each within the bounds."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_CODE_LINES, MAX_BRANCHES = 120, 12


def load_tracer():
    spec = importlib.util.spec_from_file_location("trace_forward", ROOT / "benchmarks" / "trace_forward.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_forward_and_decode_step_stay_within_the_reading_budget():
    figures = load_tracer().measure()
    assert set(figures) == {"forward", "decode_step"}
    for name, fig in figures.items():
        assert fig.code_lines <= MAX_CODE_LINES, (name, fig.code_lines, fig.functions)
        assert fig.branches <= MAX_BRANCHES, (name, fig.branches, fig.functions)
        # the model, its blocks, attention and the cache all ran: the trace saw the whole path
        assert {"models/decoder.py", "components/attention.py", "components/kv_cache.py"} <= set(fig.files)
        assert fig.executed_lines <= fig.code_lines


def test_branch_count_counts_ifs_and_conditional_expressions_but_not_nested_functions():
    tracer = load_tracer()
    fn = ast.parse(
        "def f(x):\n"
        "    if x:\n"
        "        y = 1 if x > 2 else 0\n"
        "    elif x is None:\n"
        "        y = 2\n"
        "    def g():\n"
        "        if x: return 1\n"
        "    return [v for v in range(3) if v]\n"
    ).body[0]
    assert tracer.count_branches(fn) == 3  # if, elif, the conditional expression; not g's if, not a filter


def test_the_tracer_sees_each_function_that_runs():
    tracer = load_tracer()
    figures = tracer.figures(tracer.run_traced(tracer.tiny_calls()["forward"]))
    names = " ".join(figures.functions)
    assert "DecoderLM.forward" in names and "Block.forward" in names and "SelfAttention.forward" in names
    assert "trace_forward" not in names  # only the package's own code counts
