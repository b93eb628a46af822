"""Rewards a program checks, for ``--objective grpo`` and ``tinyformer eval --reward``.

A reward is a function ``f(prompt: str, completion: str, row: dict) -> float``: ``prompt`` is the
prompt's text (its last user message), ``completion`` the generated reply's text, ``row`` the data row
with every field it has (``answer``, ``schema``, ...). ``--reward SPEC`` names one, and may be given
several times; the total reward of a completion is the weighted sum

    r = sum_i w_i f_i(prompt, completion, row)

SPEC is ``path/to/file.py:function`` (the file is imported by path, the function must take three
positional parameters) or a built-in, each optionally followed by ``=WEIGHT`` (default 1):

    builtin:exact          1 if the stripped completion equals the stripped ``row["answer"]``, else 0
    builtin:contains       1 if ``row["answer"]`` (a string, or a list of strings: all of them) occurs in the
                           completion, else 0
    builtin:json-schema    1 if the completion is JSON that validates against ``row["schema"]`` (the
                           jsonschema package), else 0
    builtin:python-import  for the built-in set's import-statement questions (rows with ``module`` and
                           ``name``): 1 if the completion (backticks or a code fence stripped) is one ``import``
                           statement that, run in a separate ``python -I`` process, binds ``name`` to
                           ``module.name``; 0 for any other row

A reward that raises, runs past ``timeout`` seconds or returns a non-finite number scores 0 for that
sample; :class:`RewardSet` counts such failures per reward and keeps the first error, which the run
reports once at its end (:meth:`RewardSet.failure_summary`), never as a traceback in the middle.

The import check (:func:`python_import_reward`) never executes the completion as code: it is parsed with
``ast`` and must be a single ``import`` / ``from ... import`` statement. That statement then runs in a child
``python -I -B`` (isolated: no user site, no environment variables, no current folder on the path; no
bytecode written) in an empty temporary folder with an empty environment, under resource limits (CPU
seconds, address space, a file-size limit of 0 bytes, no child processes) and a wall-clock limit, behind an
audit hook that refuses sockets, subprocesses and opening files for writing.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.util
import inspect
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinyformer.errors import ConfigError

__all__ = ["BUILTIN_REWARDS", "Reward", "RewardSet", "parse_reward", "python_import_reward"]

RewardFn = Callable[[str, str, dict], float]
#: seconds the child process of builtin:python-import may run
IMPORT_TIMEOUT = 5.0


class RewardTimeout(Exception):
    """A reward ran past its time limit."""


# ------------------------------------------------------------------ the built-ins


def _answer(row: dict, reward: str) -> Any:
    if "answer" not in row:
        raise KeyError(f"{reward} needs an 'answer' field in the data row")
    return row["answer"]


def exact_reward(prompt: str, completion: str, row: dict) -> float:
    """1.0 when ``completion.strip() == str(row["answer"]).strip()``, else 0.0."""
    return float(completion.strip() == str(_answer(row, "builtin:exact")).strip())


def contains_reward(prompt: str, completion: str, row: dict) -> float:
    """1.0 when every one of ``row["answer"]`` (one string or a list) occurs in ``completion``, else 0.0."""
    answer = _answer(row, "builtin:contains")
    wanted = [answer] if isinstance(answer, str) else list(answer)
    return float(all(str(w) in completion for w in wanted))


def json_schema_reward(prompt: str, completion: str, row: dict) -> float:
    """1.0 when the completion parses as JSON and validates against ``row["schema"]``, else 0.0
    (:func:`parse_reward` has checked that jsonschema is installed)."""
    import jsonschema

    if "schema" not in row:
        raise KeyError("builtin:json-schema needs a 'schema' field in the data row")
    try:
        value = json.loads(completion.strip())
    except ValueError:
        return 0.0
    try:
        jsonschema.validate(value, row["schema"])
    except jsonschema.ValidationError:
        return 0.0
    return 1.0


# the child's program: an audit hook first (no sockets, subprocesses, or files opened for writing), then the
# statement, then whether it bound NAME to MODULE.NAME (exit status 0) or not (exit status 3)
_CHILD = """
import sys
def _hook(event, args):
    if event.startswith(("socket.", "subprocess.", "os.system", "os.exec", "os.spawn", "os.fork", "os.posix_spawn",
                         "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.truncate", "shutil.")):
        raise PermissionError(event)
    if event == "open" and len(args) > 1 and isinstance(args[1], str) and any(c in args[1] for c in "wax+"):
        raise PermissionError("open for writing")
sys.addaudithook(_hook)
_module, _name = sys.argv[1], sys.argv[2]
{statement}
import importlib
_target = getattr(importlib.import_module(_module), _name)
sys.exit(0 if globals().get(_name, None) is _target and _name not in ("_module", "_name", "_target", "_hook")
         else 3)
"""


def _limits(seconds: float) -> None:  # pragma: no cover - runs in the child, between fork and exec
    import resource

    cpu = max(1, math.ceil(seconds))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))


def import_statement(completion: str) -> str | None:
    """The completion as one ``import`` / ``from ... import`` statement (blanks and backticks stripped; a reply
    that is a fenced code block, e.g. ```` ```python ````, gives the block's one line), or None when it is
    anything else (nothing that is not an import ever runs)."""
    text = completion.strip()
    if text.startswith("```"):
        lines = text.strip("`").splitlines()
        if len(lines) >= 2 and lines[0].strip().isidentifier():  # the fence's language tag
            lines = lines[1:]
        text = "\n".join(lines)
    text = text.strip().strip("`").strip()
    if not text or "\n" in text or ";" in text:
        return None
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], (ast.Import, ast.ImportFrom)):
        return None
    if isinstance(tree.body[0], ast.ImportFrom) and tree.body[0].level:
        return None  # a relative import has no package here
    return text


@functools.lru_cache(maxsize=65536)
def _run_import(statement: str, module: str, name: str, timeout: float) -> float:
    """1.0 when ``statement`` run in an isolated child binds ``name`` to ``module.name`` (cached: the check is
    a pure function of its arguments)."""
    code = _CHILD.format(statement=statement)
    with tempfile.TemporaryDirectory(prefix="tinyformer-import-") as cwd:
        try:
            done = subprocess.run([sys.executable, "-I", "-B", "-c", code, module, name], cwd=cwd, env={},
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  timeout=timeout, preexec_fn=(lambda: _limits(timeout)) if os.name == "posix"
                                  else None, check=False)
        except subprocess.TimeoutExpired:
            raise RewardTimeout(f"the import check ran past {timeout:g} s") from None
    return float(done.returncode == 0)


def python_import_reward(prompt: str, completion: str, row: dict) -> float:
    """1.0 when the completion is an import statement that binds ``row["name"]`` to ``row["module"].name``
    (checked in an isolated child process, see the module docstring); 0.0 otherwise and for rows without
    ``module`` and ``name``."""
    module, name = row.get("module"), row.get("name")
    if not module or not name:
        return 0.0
    statement = import_statement(completion)
    if statement is None:
        return 0.0
    return _run_import(statement, str(module), str(name), IMPORT_TIMEOUT)


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact": exact_reward,
    "contains": contains_reward,
    "json-schema": json_schema_reward,
    "python-import": python_import_reward,
}


# ------------------------------------------------------------------ specs


@dataclass
class Reward:
    """One named, weighted reward function."""

    name: str
    fn: RewardFn
    weight: float = 1.0


def _split_weight(spec: str) -> tuple[str, float]:
    head, sep, tail = spec.rpartition("=")
    if not sep:
        return spec, 1.0
    try:
        weight = float(tail)
    except ValueError:
        return spec, 1.0
    if not math.isfinite(weight):
        raise ConfigError(f"--reward {spec!r}: the weight must be a finite number")
    return head, weight


def _check_signature(fn: Any, where: str) -> None:
    if not callable(fn):
        raise ConfigError(f"--reward {where}: it is not a function")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: trusted
    try:
        sig.bind("prompt", "completion", {})
    except TypeError:
        raise ConfigError(f"--reward {where}: the function must take (prompt, completion, row) and return a "
                          f"float; its signature is {fn.__name__}{sig}") from None


def parse_reward(spec: str) -> Reward:
    """``builtin:NAME[=W]`` or ``path/file.py:function[=W]`` -> a :class:`Reward`; a ConfigError (one line)
    for a missing file or function, a file that fails to import, or a wrong signature."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"--reward must be builtin:NAME or path/file.py:function, got {spec!r}")
    body, weight = _split_weight(spec.strip())
    if body.startswith("builtin:"):
        key = body[len("builtin:"):]
        if key not in BUILTIN_REWARDS:
            raise ConfigError(f"--reward {body}: no such built-in reward; built-ins: "
                              f"{', '.join('builtin:' + k for k in BUILTIN_REWARDS)}")
        if key == "json-schema" and importlib.util.find_spec("jsonschema") is None:
            raise ConfigError("--reward builtin:json-schema needs the jsonschema package: pip install 'tinyformer[rl]'")
        return Reward(body, BUILTIN_REWARDS[key], weight)
    path_text, sep, func = body.rpartition(":")
    if not sep or not path_text or not func:
        raise ConfigError(f"--reward {body!r} must be builtin:NAME or path/file.py:function")
    path = Path(path_text)
    if not path.is_file():
        raise ConfigError(f"--reward {body}: reward file {path} does not exist")
    module_name = f"tinyformer_reward_{abs(hash(str(path.resolve())))}"
    try:
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise ImportError(f"{path} is not a Python file")
        module = importlib.util.module_from_spec(loader_spec)
        loader_spec.loader.exec_module(module)
    except Exception as exc:  # the user's file: any error it raises becomes one line
        raise ConfigError(f"--reward {body}: importing {path} failed: {type(exc).__name__}: {exc}") from None
    fn = getattr(module, func, None)
    if fn is None:
        raise ConfigError(f"--reward {body}: {path} has no function {func!r}")
    _check_signature(fn, body)
    return Reward(body, fn, weight)


# ------------------------------------------------------------------ scoring, with failures counted


@dataclass
class RewardSet:
    """The rewards of a run, each call guarded: a failure (exception, timeout, non-finite value) scores 0 and
    is counted in ``failures`` (reward name -> count) with its first error kept in ``first_error``."""

    rewards: list[Reward]
    timeout: float  # seconds one reward call may take before it scores 0 (counted as a failure)
    failures: Counter = field(default_factory=Counter)
    first_error: dict[str, str] = field(default_factory=dict)
    calls: int = 0

    @classmethod
    def from_specs(cls, specs: Sequence[str], timeout: float) -> RewardSet:
        if not specs:
            raise ConfigError("give at least one --reward: builtin:exact, builtin:contains, builtin:json-schema, "
                              "builtin:python-import or path/file.py:function")
        return cls([parse_reward(s) for s in specs], timeout)

    def describe(self) -> str:
        return " + ".join(r.name if r.weight == 1 else f"{r.weight:g} x {r.name}" for r in self.rewards)

    def _call(self, reward: Reward, prompt: str, completion: str, row: dict) -> float:
        try:
            with _time_limit(self.timeout):
                value = reward.fn(prompt, completion, dict(row))
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"returned {value}")
        except Exception as exc:  # the user's function: every failure scores 0 and is counted
            self.failures[reward.name] += 1
            self.first_error.setdefault(reward.name, f"{type(exc).__name__}: {exc}")
            return 0.0
        return value

    def score(self, prompt: str, completion: str, row: dict) -> float:
        """The weighted sum of the rewards of one completion (failures count 0)."""
        self.calls += 1
        return sum(r.weight * self._call(r, prompt, completion, row) for r in self.rewards)

    def failure_summary(self) -> str | None:
        """One line per failing reward ('builtin:exact failed 3 of 120 calls (scored 0); first error: ...'), or
        None when none failed."""
        if not self.failures:
            return None
        return "; ".join(f"reward {name} failed {n} of {self.calls} calls (scored 0); first error: "
                         f"{self.first_error[name]}" for name, n in self.failures.items())

    def state(self) -> dict[str, Any]:
        return {"failures": dict(self.failures), "first_error": dict(self.first_error), "calls": self.calls}

    def load_state(self, state: dict[str, Any] | None) -> None:
        if state:
            self.failures = Counter(state.get("failures", {}))
            self.first_error = dict(state.get("first_error", {}))
            self.calls = int(state.get("calls", 0))


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`RewardTimeout` in the main thread after ``seconds`` (SIGALRM; no limit elsewhere)."""
    if seconds <= 0 or not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(signum: int, frame: Any) -> None:
        raise RewardTimeout(f"ran past its limit of {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
