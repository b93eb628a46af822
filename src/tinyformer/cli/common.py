"""Helpers shared by the subcommands: loading a model config from a preset, file or run folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tinyformer.config import ModelConfig
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


def load_model_config(path: str | Path) -> ModelConfig:
    """A ModelConfig from a run folder, a config.json, or a YAML/TOML/JSON file whose fields are at the
    top level or under a ``model:`` key (which may name a ``preset`` plus overrides)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    data = read_structured_file(p)
    if isinstance(data.get("model"), dict):
        data = data["model"]
    data = dict(data)
    preset = data.pop("preset", None)
    if preset is not None:
        from tinyformer.presets import get_preset

        return get_preset(preset, **data)
    return ModelConfig.from_dict(data)


def add_no_verify_flag(p: Any) -> None:
    """``--no-verify`` of every command that loads a run's weights (see integrity.py)."""
    p.add_argument("--no-verify", action="store_true",
                   help="load the weights without checking them against the run's manifest.json checksums")
