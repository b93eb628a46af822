"""Run folders written by an earlier version of tinyformer still load and compute the same numbers.

tests/fixtures/runs/ holds small run folders (decoder with GQA and sliding-window layers, a LoRA run on it,
int8 and int4 copies, a BERT-style encoder, the 2017 encoder-decoder) saved by the code of the day they were
made, each with ``expected.safetensors``: what that code computed on fixed inputs
(tests/fixtures/make_run_fixtures.py). A restructuring that renames a parameter, changes a formula or breaks
loading fails here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from quant_helpers import load_weight_only
from safetensors.torch import load_file

from tinyformer.run_folder import load_model, load_tokenizer

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))

import make_run_fixtures as fx  # noqa: E402

RUNS = FIXTURES / "runs"
#: float32 on any CPU path; the quantized kernels may take another vector path (AVX-512 VNNI vs AMX) on
#: another machine, so they get a looser bound
TOLERANCE = {"decoder": 1e-5, "lora": 1e-5, "int8": 2e-3, "int4": 2e-3, "encoder": 1e-5, "seq2seq": 1e-5}


def expected(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(RUNS / name / "expected.safetensors"))


@pytest.mark.parametrize("name", ["decoder", "lora", "int8", "int4"])
def test_old_decoder_run_folders_give_the_same_logits(name):
    model = load_weight_only(RUNS / name)  # the int8 / int4 runs were recorded with the weight-only kernel
    got = fx.decoder_outputs(model)
    for key, want in expected(name).items():
        torch.testing.assert_close(got[key].float(), want, atol=TOLERANCE[name], rtol=TOLERANCE[name], msg=key)


def test_old_decoder_cached_decode_equals_its_own_full_forward():
    """The recorded cached decode agrees with the recorded full forward (the record itself is consistent)."""
    want = expected("decoder")
    torch.testing.assert_close(want["cached_logits"], want["logits"][:, 7:], atol=1e-5, rtol=1e-5)


def test_old_encoder_run_folder_gives_the_same_hidden_states():
    model = load_model(RUNS / "encoder")
    mask = torch.ones_like(fx.DECODER_IDS)
    mask[1, -3:] = 0
    want = expected("encoder")
    with torch.no_grad():
        torch.testing.assert_close(model(fx.DECODER_IDS, attention_mask=mask), want["hidden"], atol=1e-5, rtol=1e-5)
        if "mlm_logits" in want:
            torch.testing.assert_close(model.mlm_logits(fx.DECODER_IDS, attention_mask=mask), want["mlm_logits"],
                                       atol=1e-5, rtol=1e-5)


def test_old_seq2seq_run_folder_gives_the_same_logits():
    model = load_model(RUNS / "seq2seq")
    with torch.no_grad():
        got = model(fx.SOURCE_IDS, fx.TARGET_IDS)
    torch.testing.assert_close(got, expected("seq2seq")["logits"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(TOLERANCE))
def test_old_run_folders_keep_their_tokenizer(name):
    assert load_tokenizer(RUNS / name).decode(load_tokenizer(RUNS / name).encode(fx.TEXT)) == fx.TEXT
