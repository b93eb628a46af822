"""Config files (JSON, YAML, TOML) read into dicts, with one-line errors naming the file, line and column.

Shared by the run-config files of ``tinyformer train`` (``training/train_config.py``) and the model configs the
commands read (``cli/common.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tinyformer.errors import ConfigError
from tinyformer.utils.io import read_utf8


def _parse_error(path: Path, exc: Exception) -> str:
    """One line naming the file, line and column of a YAML/JSON/TOML syntax error (YAML's own message
    spans several lines with a picture of the spot)."""
    mark = getattr(exc, "problem_mark", None)
    if mark is not None:  # yaml.MarkedYAMLError
        problem = " ".join(str(x) for x in (getattr(exc, "context", None), getattr(exc, "problem", None)) if x)
        return f"{path}, line {mark.line + 1}, column {mark.column + 1}: {problem or type(exc).__name__}"
    if isinstance(exc, json.JSONDecodeError):
        return f"{path}, line {exc.lineno}, column {exc.colno}: {exc.msg}"
    return f"{path}: " + " ".join(str(exc).split())  # tomllib: "... (at line L, column C)"


def read_structured_file(path: str | Path) -> dict[str, Any]:
    """Parse a JSON, YAML or TOML file into a dict, with a clear error naming the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    text = read_utf8(p, ConfigError, "config file")
    suffix = p.suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        elif suffix == ".toml":
            data = toml_loads(text)
        else:
            data = json.loads(text)
    except RecursionError:
        raise ConfigError(f"cannot parse {p}: nested too deeply (thousands of levels of brackets)") from None
    except Exception as exc:  # parse errors of three libraries: report them the same way
        raise ConfigError(f"cannot parse {_parse_error(p, exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p} must hold a mapping of fields at the top level")
    return data


def toml_loads(text: str) -> Any:
    """Parse TOML with the standard library's ``tomllib`` (Python 3.11+) or, on 3.10, the ``tomli`` backport
    it was adopted from (same API; a dependency for ``python_version < '3.11'`` in pyproject.toml)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise ConfigError("TOML configs on Python 3.10 need the tomli package: pip install tomli") from None
    return tomllib.loads(text)
