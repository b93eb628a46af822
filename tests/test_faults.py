"""Hostile and unlucky input: declared sizes past the file's end, configs no machine can build, full and
read-only disks, deeply nested JSON, two writers on one run folder, temporaries left by a killed run.

Each case ends as ONE line on stderr with exit code 2 (``fails_in_one_line``), and nothing already on
disk is lost. The commands run in this process through ``main``: an exception that is not handled
propagates and fails the test with its traceback.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from test_cli_errors import fails_in_one_line, run, trained  # noqa: F401 - fixtures: a tiny finished run

from tinyformer.cli.main import main


def _gguf_string(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def test_gguf_array_declaring_more_items_than_the_file_holds_is_refused_at_once(tmp_path, capsys):
    # 119 bytes: one string entry, then a u8 array that says it holds 10^12 items
    data = (b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + _gguf_string(b"general.architecture")
            + struct.pack("<I", 8) + _gguf_string(b"llama")
            + _gguf_string(b"x.bomb") + struct.pack("<IIQ", 9, 0, 10**12) + b"\0" * 20)
    path = tmp_path / "bomb.gguf"
    path.write_bytes(data)
    fails_in_one_line(["convert", "--from-gguf", str(path), "--out", str(tmp_path / "out")], capsys,
                      "bomb.gguf", "1,000,000,000,000 items", "only 20 remain")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("count_field", ["tensor_count", "kv_count", "string_length"])
def test_gguf_counts_past_the_end_are_refused(tmp_path, capsys, count_field):
    kv, tensors, key = 1, 0, _gguf_string(b"general.architecture")
    if count_field == "tensor_count":
        tensors = 2**40
    elif count_field == "kv_count":
        kv = 2**50
    else:
        key = struct.pack("<Q", 2**60) + b"general"
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, tensors, kv) + key + struct.pack("<I", 8)
                     + _gguf_string(b"llama"))
    fails_in_one_line(["convert", "--from-gguf", str(path), "--out", str(tmp_path / "out")], capsys,
                      "bad.gguf", "remain")


def _tiny_hf_folder(folder: Path, **config) -> Path:
    pytest.importorskip("transformers")
    from test_interop_common import hf_model, save_hf

    save_hf(hf_model("llama", num_hidden_layers=1), folder, tokenizer=False)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(config)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("field,value", [("num_hidden_layers", 10**6), ("max_position_embeddings", 10**12)])
def test_hf_config_no_machine_can_build_is_refused_before_import(tmp_path, capsys, monkeypatch, field, value):
    import tinyformer.sizing

    monkeypatch.setattr(tinyformer.sizing, "machine_memory_bytes", lambda: 8 * 10**9)  # an 8 GB machine
    src = _tiny_hf_folder(tmp_path / "hf", **{field: value})
    fails_in_one_line(["convert", "--from-hf", str(src), "--out", str(tmp_path / "out")], capsys,
                      "would allocate", "8.0 GB of memory")
    assert not (tmp_path / "out").exists()
