"""Sentence-transformers folders in the bert family: a BERT plus its pooling.

A sentence-transformers folder (``modules.json``) is a Transformer module (a BERT folder at the root or in
``0_Transformer/``), a Pooling module (``1_Pooling/config.json``: cls, mean or max) and optionally a Normalize module.
``interop.hf_folder.import_sentence_transformers`` imports the BERT with the family's adapter and records what
``read_sentence_transformers`` finds in the run's ``extra["sentence_transformers"]``, which ``tinyformer embed``
follows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tinyformer.errors import CheckpointError, ConfigError

ReadJson = Callable[..., Any]  # read_json(path, what, kind=dict): one JSON file, CheckpointError naming a bad one

POOLING_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max"}
UNSUPPORTED_POOLING = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens",
                       "pooling_mode_lasttoken")


def read_sentence_transformers(folder: str | Path, read_json: ReadJson) -> tuple[Path, dict[str, Any]]:
    """(the folder of the Transformer module, {"pooling", "normalize", "max_seq_length"}) of a
    sentence-transformers folder; ConfigError naming any module or pooling mode that is not supported.
    ``read_json(path, what, kind=dict)`` reads one JSON file (``interop.tensor_sources.read_json``)."""
    folder = Path(folder)
    modules_json = folder / "modules.json"
    modules = read_json(modules_json, "the module list of a sentence-transformers folder", kind=list)
    if not all(isinstance(m, dict) for m in modules):
        raise CheckpointError(f"{modules_json} must hold a list of modules")
    transformer_dir: Path | None = None
    pooling: str | None = None
    normalize = False
    for module in sorted(modules, key=lambda m: m.get("idx", 0)):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        path = folder / str(module.get("path", ""))
        if kind == "Transformer":
            transformer_dir = path
        elif kind == "Pooling":
            pooling = pooling_mode(read_json(path / "config.json", "sentence-transformers pooling config"))
        elif kind == "Normalize":
            normalize = True
        else:
            raise ConfigError(f"{modules_json}: module {module.get('type')!r} is not supported "
                              "(supported: Transformer, Pooling, Normalize)")
    if transformer_dir is None:
        raise CheckpointError(f"{modules_json} lists no Transformer module")
    info: dict[str, Any] = {"pooling": pooling or "mean", "normalize": normalize}
    # the truncation length: sentence_bert_config.json (older versions), else the tokenizer's model_max_length
    for name, key in (("sentence_bert_config.json", "max_seq_length"), ("tokenizer_config.json", "model_max_length")):
        path = transformer_dir / name
        max_len = read_json(path, "sentence-transformers config").get(key) if path.is_file() else None
        if isinstance(max_len, int) and 0 < max_len < 1_000_000:  # HF writes a huge sentinel when unset
            info["max_seq_length"] = max_len
            break
    return transformer_dir, info


def pooling_mode(config: Mapping[str, Any]) -> str:
    """The pooling of a ``1_Pooling/config.json``: ``"pooling_mode": "mean"`` (sentence-transformers >= 6) or
    one ``pooling_mode_*_tokens: true`` flag (older versions)."""
    mode = config.get("pooling_mode")
    if isinstance(mode, (list, tuple)) and len(mode) == 1:
        mode = mode[0]
    if mode is not None:
        if mode not in POOLING_KEYS.values():
            raise ConfigError(f"sentence-transformers pooling_mode {mode!r} is not supported (supported: cls, mean, "
                              "max)")
        return str(mode)
    for key in UNSUPPORTED_POOLING:
        if config.get(key):
            raise ConfigError(f"sentence-transformers pooling {key} is not supported (supported: cls, mean, max)")
    modes = [mode for key, mode in POOLING_KEYS.items() if config.get(key)]
    if len(modes) != 1:
        raise ConfigError("sentence-transformers pooling must use exactly one of cls, mean, max; "
                          f"got {modes or 'none'}")
    return modes[0]
