"""Packaging: what pyproject.toml promises matches the source tree, and Python 3.10 can read TOML configs."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from tinyformer.config_files import toml_loads

ROOT = Path(__file__).resolve().parents[1]
# the real parser under either name: tomllib (3.11+) is tomli adopted into the standard library
TOML = importlib.import_module("tomllib") if sys.version_info >= (3, 11) else pytest.importorskip("tomli")


def test_every_package_data_pattern_matches_a_file():
    project = toml_loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    for package, patterns in project["tool"]["setuptools"]["package-data"].items():
        base = ROOT / "src" / package.replace(".", "/")
        for pattern in patterns:
            assert any(p.is_file() for p in base.glob(pattern)), f"package-data {package}: {pattern} matches nothing"


def test_python_310_reads_toml_configs_with_tomli(tmp_path, monkeypatch):
    """On 3.10 there is no tomllib; the config reader falls back to tomli (a dependency there)."""
    from tinyformer.config_files import read_structured_file

    (tmp_path / "run.toml").write_text('[train]\nlr = 3e-4\n[model]\npreset = "tiny"\n')
    monkeypatch.setitem(sys.modules, "tomllib", None)  # import tomllib -> ModuleNotFoundError, as on 3.10
    monkeypatch.setitem(sys.modules, "tomli", TOML)
    assert read_structured_file(tmp_path / "run.toml") == {"train": {"lr": 3e-4}, "model": {"preset": "tiny"}}


def test_python_310_without_tomli_says_what_to_install(tmp_path, monkeypatch):
    from tinyformer.config_files import read_structured_file
    from tinyformer.errors import ConfigError

    (tmp_path / "run.toml").write_text("[train]\n")
    monkeypatch.setitem(sys.modules, "tomllib", None)
    monkeypatch.setitem(sys.modules, "tomli", None)
    with pytest.raises(ConfigError, match="pip install tomli"):
        read_structured_file(tmp_path / "run.toml")


def test_tomli_is_a_dependency_below_python_311():
    project = toml_loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    deps = project["project"]["dependencies"]
    assert any(d.replace(" ", "").startswith("tomli>=") and "python_version<'3.11'" in d.replace(" ", "")
               for d in deps), deps


def test_the_readme_commands_pictures_need_no_extra():
    """The README's main command writes loss.png and its inspect example draws PNGs: matplotlib must come
    with a plain `pip install -e .`."""
    project = toml_loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert any(d.replace(" ", "").startswith("matplotlib") for d in project["project"]["dependencies"])
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert 'pip install -e . && tinyformer train --out runs/default' in readme
