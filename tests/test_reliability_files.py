"""Corrupt weights, NaN outputs, index files that point outside, and `convert --force` over foreign files.

Each run folder here is written by ``save_model`` (which records the manifest) from a tiny random model
and a char tokenizer; the damage is then done with plain file operations.
"""

from __future__ import annotations

import io
import json
import string
import sys
import zlib
from pathlib import Path

import pytest
import torch

from tinyformer.cli.main import main
from tinyformer.config import ModelConfig
from tinyformer.data.tokenizer import build_tokenizer
from tinyformer.errors import CheckpointError
from tinyformer.integrity import MANIFEST
from tinyformer.interop.tensor_sources import open_hf_weights
from tinyformer.models.decoder import DecoderLM
from tinyformer.run_folder import load_model, save_model, state_dict_for_saving

pytestmark = pytest.mark.usefixtures("one_thread")


def make_run(folder: Path, nan: bool = False, max_shard_bytes: int = 2**30) -> Path:
    tok = build_tokenizer("char", string.printable)
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layer=1, n_head=2, n_kv_head=2,
                                  d_ff=64, max_seq_len=32))
    if nan:
        with torch.no_grad():
            model.tok_emb.weight.fill_(float("nan"))
    save_model(folder, model, max_shard_bytes=max_shard_bytes)
    tok.save(folder)
    return folder


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def generate(run: Path, *extra: str) -> int:
    return main(["generate", "--model", str(run), "--prompt", "ab", "--max-new-tokens", "3", "--temperature", "0",
                 *extra])


# ---------------------------------------------------------------------------- checksums


def test_manifest_records_the_size_and_crc32_of_each_weight_file(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", max_shard_bytes=20_000)
    files = json.loads((run / MANIFEST).read_text())["files"]
    shards = sorted(p.name for p in run.glob("model-*.safetensors"))
    assert len(shards) > 1 and sorted(files) == sorted([*shards, "model.safetensors.index.json"])
    for name, entry in files.items():
        data = (run / name).read_bytes()
        assert entry == {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.write_bytes(p.read_bytes()[:-1] + bytes([p.read_bytes()[-1] ^ 1])), "checksum"),
    (lambda p: p.write_bytes(p.read_bytes()[:-4]), "bytes"),
], ids=["flipped-bit", "truncated"])
def test_corrupt_weights_are_refused_unless_no_verify(damage, message: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    run = make_run(tmp_path / "run")
    damage(run / "model.safetensors")
    assert generate(run) == 2
    err = one_line_error(capsys)
    assert message in err and "model.safetensors" in err and "--no-verify" in err
    if message == "checksum":  # a flipped bit in the last weight still parses: --no-verify loads it
        assert generate(run, "--no-verify") == 0


def test_one_corrupt_shard_of_several_is_named(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", max_shard_bytes=20_000)
    shard = sorted(run.glob("model-*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x80
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=shard.name):
        load_model(run)
    load_model(run, verify=False)


def test_a_run_without_manifest_still_loads(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    expected = state_dict_for_saving(load_model(run))
    (run / MANIFEST).unlink()
    got = state_dict_for_saving(load_model(run))
    assert all(torch.equal(expected[k], got[k]) for k in expected)


# ---------------------------------------------------------------------------- index files


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors",
                                  "C:\\x.safetensors"])
def test_an_index_naming_a_file_outside_the_folder_is_refused(name: str, tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", max_shard_bytes=20_000)
    index = run / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = name
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="outside the model folder"):
        load_model(run, verify=False)
    with pytest.raises(CheckpointError, match="outside the model folder"):
        open_hf_weights(run)  # the importer's reader of HF folders


# ---------------------------------------------------------------------------- non-finite outputs


def test_nan_weights_are_a_clear_error_in_generate_chat_and_eval(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    run = make_run(tmp_path / "run", nan=True)
    assert generate(run) == 2
    assert "non-finite logits" in one_line_error(capsys)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    assert main(["chat", "--model", str(run), "--max-new-tokens", "3"]) == 2
    assert "non-finite logits" in one_line_error(capsys)
    data = tmp_path / "data.txt"
    data.write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    monkeypatch.setenv("TINYFORMER_CACHE", str(tmp_path / "cache"))
    assert main(["eval", "--model", str(run), "--data", str(data), "--block-size", "16", "--no-progress"]) == 2
    assert "non-finite logits" in one_line_error(capsys)


def test_nan_weights_give_an_error_response_not_a_500_or_garbage(tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from serve_helpers import BackgroundServer

    from tinyformer.run_folder import load_tokenizer
    from tinyformer.serve.app import create_app

    run = make_run(tmp_path / "run", nan=True)
    app = create_app(load_model(run), load_tokenizer(run), model_name="m", max_batch=2)
    with BackgroundServer(app) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"model": "m", "prompt": "ab", "max_tokens": 3}, timeout=30)
    assert r.status_code == 503, r.text
    assert "non-finite logits" in r.json()["error"]["message"]


# ---------------------------------------------------------------------------- convert --force


def test_convert_force_replaces_its_own_output_but_refuses_foreign_files(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    run = make_run(tmp_path / "run")
    out = tmp_path / "hf"
    assert main(["convert", "--model", str(run), "--to-hf", str(out)]) == 0
    assert main(["convert", "--model", str(run), "--to-hf", str(out), "--force"]) == 0  # its own files: replaced
    (out / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert main(["convert", "--model", str(run), "--to-hf", str(out), "--force"]) == 2
    assert "notes.txt" in one_line_error(capsys)
    assert (out / "notes.txt").read_text() == "mine" and (out / "config.json").is_file()
