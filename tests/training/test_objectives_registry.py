"""The objective registry (training/objectives/__init__.py) lists every objective its folder defines, by the
name the class declares, and names the known ones when asked for another."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import tinyformer.training.objectives as objectives
from tinyformer.errors import ConfigError
from tinyformer.training.objectives.base import Objective


def defined_objectives() -> dict[str, type[Objective]]:
    """name -> class of every concrete objective (a subclass of Objective with a name) in the folder's modules."""
    found = {}
    for info in pkgutil.iter_modules(objectives.__path__):
        module = importlib.import_module(f"{objectives.__name__}.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, Objective) and cls.__module__ == module.__name__ and cls.name:
                found[cls.name] = cls
    return found


def test_every_objective_in_the_folder_is_registered_under_its_own_name():
    assert objectives.OBJECTIVES == defined_objectives()
    assert sorted(objectives.OBJECTIVES) == ["clm", "dpo", "grpo", "mlm", "seq2seq", "sft"]


def test_an_unknown_objective_names_the_known_ones():
    with pytest.raises(ConfigError, match="known objectives: clm, dpo, grpo, mlm, seq2seq, sft"):
        objectives.get_objective("ppo")
