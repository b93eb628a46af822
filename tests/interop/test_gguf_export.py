"""GGUF export, checked by transformers' own GGUF loader (an independent reader of the file), by the gguf
package's reader, and by importing the file back."""

from __future__ import annotations

import pytest
import torch
from quant_helpers import load_weight_only
from test_interop_common import (
    CHAT_TEMPLATE,
    SAMPLES,
    hf_model,
    padded_batch,
    pytestmark,  # noqa: F401 - one intra-op thread for every test here
    save_hf,
)

from tinyformer.cli.main import main
from tinyformer.components.quantized import QuantSpec
from tinyformer.config import ModelConfig
from tinyformer.generation.generator import Generator
from tinyformer.generation.sampling import SamplingParams
from tinyformer.interop.gguf import import_gguf
from tinyformer.interop.gguf_export import export_gguf
from tinyformer.interop.hf_folder import import_hf
from tinyformer.models import build_model
from tinyformer.quantization import quantize_run
from tinyformer.run_folder import iter_tensors, load_config, load_model, load_tokenizer, save_model

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers' GGUF loader requires it


def transformers_gguf(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True,
                                                              dtype=torch.float32)
    return model.eval()


def same_model_fields(a: ModelConfig, b: ModelConfig) -> None:
    da, db = a.to_dict(), b.to_dict()
    da.pop("extra"), db.pop("extra")
    assert da == db


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    """A Llama run (GQA, untied head) with a byte-level BPE tokenizer and a chat template."""
    root = tmp_path_factory.mktemp("bpe")
    save_hf(hf_model("llama", tie_word_embeddings=False), root / "hf")
    import_hf(root / "hf", root / "run")
    return root / "run"


def test_f32_export_loads_in_transformers_with_the_same_logits_and_tokenizer(bpe_run, tmp_path):
    export_gguf(bpe_run, tmp_path / "model.gguf", "f32")
    theirs = transformers_gguf(tmp_path / "model.gguf")
    ids, mask = padded_batch()
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        ours = load_model(bpe_run)(ids, attention_mask=mask)
        ref = theirs(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    scale = ours[mask.bool()].abs().max()
    torch.testing.assert_close(ref[mask.bool()] / scale, ours[mask.bool()] / scale, atol=1e-4, rtol=0)
    tok = load_tokenizer(bpe_run)
    their_tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="model.gguf", local_files_only=True)
    for text in SAMPLES:
        assert their_tok(text, add_special_tokens=False)["input_ids"] == tok.encode(text), text
    reader = gguf.GGUFReader(str(tmp_path / "model.gguf"))
    assert reader.fields["tokenizer.chat_template"].contents() == CHAT_TEMPLATE
    assert reader.fields["tokenizer.ggml.eos_token_id"].contents() == tok.eos_id


def test_reimporting_the_export_gives_the_same_run(bpe_run, tmp_path):
    export_gguf(bpe_run, tmp_path / "model.gguf", "f32")
    import_gguf(tmp_path / "model.gguf", tmp_path / "back")
    same_model_fields(load_config(tmp_path / "back"), load_config(bpe_run))
    back = dict(iter_tensors(tmp_path / "back"))
    for name, tensor in iter_tensors(bpe_run):
        assert torch.equal(back[name], tensor), name
    ours, theirs = load_tokenizer(bpe_run), load_tokenizer(tmp_path / "back")
    for text in SAMPLES:
        assert ours.encode(text) == theirs.encode(text)
    assert theirs.chat_template == ours.chat_template


def test_trained_char_model_exported_as_q8_0_decodes_the_same_greedy_tokens_in_transformers(trained_char_run,
                                                                                             tmp_path):
    run, _ = trained_char_run
    export_gguf(run, tmp_path / "model.gguf", "q8_0")
    theirs = transformers_gguf(tmp_path / "model.gguf")
    tok = load_tokenizer(run)
    their_tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="model.gguf", local_files_only=True)
    text = "the cat sat on the mat, and she sells sea shells"
    prompt = tok.encode(text)
    # transformers' GGUF SentencePiece tokenizer ignores tokenizer.ggml.add_space_prefix = false (llama.cpp honours
    # it) and puts a "▁" first; past that piece the ids are the char tokenizer's
    their_ids = their_tok(text, add_special_tokens=False)["input_ids"]
    assert their_ids == [tok.token_to_id(" ")] + prompt
    back = import_gguf(tmp_path / "model.gguf", tmp_path / "back").out
    for sample in [text, " the sea", "sea shells  twice"]:
        assert load_tokenizer(back).encode(sample) == tok.encode(sample), sample
        assert load_tokenizer(back).decode(tok.encode(sample)) == sample
    ours = Generator(load_model(run), tok).generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=40),
                                                   logprobs=False)[0].token_ids
    with torch.no_grad():
        out = theirs.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=None,
                              pad_token_id=tok.pad_id)
    assert out[0, len(prompt):].tolist() == ours[: out.shape[1] - len(prompt)]


def test_quantized_run_exports_its_dequantized_weights(trained_char_run, tmp_path):
    run, _ = trained_char_run
    quantize_run(run, tmp_path / "q", QuantSpec("int8", 32))
    export_gguf(tmp_path / "q", tmp_path / "model.gguf", "f32")
    import_gguf(tmp_path / "model.gguf", tmp_path / "back")
    ids = torch.tensor([load_tokenizer(run).encode("the quick brown fox")])
    with torch.no_grad():
        # the weight-only kernel: the file holds dequant(W), which the default (8-bit activations) only nears
        torch.testing.assert_close(load_model(tmp_path / "back")(ids), load_weight_only(tmp_path / "q")(ids),
                                   rtol=1e-4, atol=1e-4)


def test_encoder_and_bad_requests_give_one_line_and_write_nothing(tmp_path, capsys):
    cfg = ModelConfig(arch="encoder", vocab_size=64, d_model=32, n_layer=1, n_head=2, pos="learned", norm="layernorm",
                      ffn="gelu", tie_embeddings=False)
    save_model(tmp_path / "enc", build_model(cfg))
    for args, message in [(["--model", str(tmp_path / "enc")], "arch='encoder'"),
                          (["--model", str(tmp_path / "enc"), "--type", "q8_0"], "arch='encoder'")]:
        code = main(["convert", *args, "--to-gguf", str(tmp_path / "x.gguf")])
        err = capsys.readouterr().err
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1
        assert not (tmp_path / "x.gguf").exists() and not list(tmp_path.glob(".x.gguf*"))


@pytest.mark.parametrize("qtype", ["f16", "bf16", "q4_0"])
def test_every_export_type_is_read_alike_by_transformers_and_by_the_importer(bpe_run, qtype, tmp_path):
    """Both readers dequantize the file the same way: logits within 1e-4 of the logit scale; the file says its type."""
    export_gguf(bpe_run, tmp_path / "model.gguf", qtype)
    reader = gguf.GGUFReader(str(tmp_path / "model.gguf"))
    want = {"f16": "F16", "bf16": "BF16", "q4_0": "Q4_0"}[qtype]
    assert reader.fields["general.file_type"].contents() == int(getattr(gguf.LlamaFileType, "MOSTLY_" + want))
    assert {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2} == {want}
    import_gguf(tmp_path / "model.gguf", tmp_path / "back", dtype="float32")
    ids, mask = padded_batch()
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        ours = load_model(tmp_path / "back")(ids, attention_mask=mask)[mask.bool()]
        ref = transformers_gguf(tmp_path / "model.gguf")(input_ids=ids, attention_mask=mask,
                                                           position_ids=pos).logits[mask.bool()]
    scale = ref.abs().max()
    torch.testing.assert_close(ours / scale, ref / scale, atol=1e-4, rtol=0)
