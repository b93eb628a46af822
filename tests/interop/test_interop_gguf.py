"""GGUF import, checked against transformers' own GGUF loader and against the model the file was written from.

The files are written here with the gguf package (GGUFWriter), the way llama.cpp's converter lays them
out: q/k rows permuted for the 'llama' architecture, norms in F32, matrices in the type under test.
transformers' loader (``from_pretrained(dir, gguf_file=...)``) dequantizes with the same
``gguf.quants.dequantize`` and undoes the same permutation, so its weights must equal ours exactly.
It reads neither RoPE scaling metadata nor the ``rope_freqs`` tensor of llama3 scaling (a transformers
limitation); those imports are compared with the transformers model the file was written from.
"""

from __future__ import annotations

import json

import pytest
import torch
from quant_helpers import load_weight_only
from test_interop_common import (
    CHAT_TEMPLATE,
    SAMPLES,
    bpe_backend,
    hf_logits,
    hf_model,
    llama_cpp_rope_freqs,
    padded_batch,
    pytestmark,  # noqa: F401 - one intra-op thread for every test here
    write_gguf,
)

from tinyformer.errors import CheckpointError, ConfigError
from tinyformer.families import tinyformer_to_hf
from tinyformer.interop.gguf import import_gguf
from tinyformer.run_folder import iter_tensors, load_config, load_model, load_tokenizer

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers' GGUF loader requires it

# K-quants need rows of whole 256-value super-blocks: every matrix has 256 or 512 columns here
BIG = dict(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=64)


def transformers_gguf(folder, name="model.gguf"):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, local_files_only=True,
                                                              dtype=torch.float32)
    return model.eval()


def our_hf_state_dict(run) -> dict[str, torch.Tensor]:
    cfg = load_config(run)
    return {k: v.float() for k, v in tinyformer_to_hf(cfg, dict(iter_tensors(run)))}


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_import_equals_transformers_gguf_loading(qtype, tmp_path):
    model = hf_model("llama", **BIG)
    write_gguf(model, tmp_path / "model.gguf", qtype=qtype)
    # default precision: the file's float type when every matrix has it, else float32
    report = import_gguf(tmp_path / "model.gguf", tmp_path / "default")
    assert report.dtype == {"F16": torch.float16, "BF16": torch.bfloat16}.get(qtype, torch.float32)
    import_gguf(tmp_path / "model.gguf", tmp_path / "run", dtype="float32")  # F32 norms kept exact
    theirs = transformers_gguf(tmp_path)
    ours = our_hf_state_dict(tmp_path / "run")
    reference = theirs.state_dict()
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, reference[name].float(), rtol=1e-6, atol=1e-6, msg=name)
    ids, mask = padded_batch()
    with torch.no_grad():
        logits = load_model(tmp_path / "run", dtype=torch.float32)(ids, attention_mask=mask)
    torch.testing.assert_close(logits[mask.bool()], hf_logits(theirs, ids, mask)[mask.bool()], atol=1e-4, rtol=1e-4)


def test_float_gguf_reproduces_the_original_model(tmp_path):
    """Independent of transformers' GGUF loader: the q/k permutation is undone exactly."""
    model = hf_model("llama", tie_word_embeddings=True)
    write_gguf(model, tmp_path / "model.gguf", qtype="F32")
    import_gguf(tmp_path / "model.gguf", tmp_path / "run")
    ours = our_hf_state_dict(tmp_path / "run")
    for name, tensor in model.state_dict().items():
        if name != "lm_head.weight":
            assert torch.equal(ours[name], tensor), name
    ids, mask = padded_batch()
    with torch.no_grad():
        logits = load_model(tmp_path / "run")(ids, attention_mask=mask)
    torch.testing.assert_close(logits[mask.bool()], hf_logits(model, ids, mask)[mask.bool()], atol=1e-4, rtol=1e-4)


def test_qwen2_gguf_keeps_rows_and_biases(tmp_path):
    model = hf_model("qwen2", **BIG)
    write_gguf(model, tmp_path / "model.gguf", qtype="Q8_0", arch="qwen2")
    import_gguf(tmp_path / "model.gguf", tmp_path / "run")
    assert load_config(tmp_path / "run").attn_bias
    theirs = transformers_gguf(tmp_path)
    ids, mask = padded_batch()
    with torch.no_grad():
        logits = load_model(tmp_path / "run")(ids, attention_mask=mask)
    torch.testing.assert_close(logits[mask.bool()], hf_logits(theirs, ids, mask)[mask.bool()], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("scaling", ["linear", "yarn", "llama3"])
def test_rope_scaling_in_gguf_is_recovered(scaling, tmp_path):
    params = {
        "linear": {"rope_type": "linear", "factor": 2.0},
        "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192},
    }[scaling]
    model = hf_model("llama", head_dim=32, num_attention_heads=2, num_key_value_heads=1,
                     rope_parameters={**params, "rope_theta": 500000.0})
    if scaling == "llama3":  # llama.cpp stores it as per-frequency divisors
        freqs = llama_cpp_rope_freqs(32, 500000.0, 8.0, 1.0, 4.0, 8192)
        write_gguf(model, tmp_path / "model.gguf", rope_freqs=freqs)
    else:
        meta = {"type": scaling, "factor": params["factor"]}
        if scaling == "yarn":
            meta["original"] = params["original_max_position_embeddings"]
        write_gguf(model, tmp_path / "model.gguf", rope_scaling=meta)
    import_gguf(tmp_path / "model.gguf", tmp_path / "run")
    assert load_config(tmp_path / "run").rope_type == scaling
    ids, mask = padded_batch(length=40)
    with torch.no_grad():
        logits = load_model(tmp_path / "run")(ids, attention_mask=mask)
    torch.testing.assert_close(logits[mask.bool()], hf_logits(model, ids, mask)[mask.bool()], atol=1e-4, rtol=1e-4)


def test_gpt2_style_tokenizer_and_chat_template_come_along(tmp_path):
    model = hf_model("llama")
    write_gguf(model, tmp_path / "model.gguf", qtype="F16")
    import_gguf(tmp_path / "model.gguf", tmp_path / "run")
    ours = load_tokenizer(tmp_path / "run")
    original = bpe_backend()
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="model.gguf", local_files_only=True)
    for text in SAMPLES:
        ids = ours.encode(text)
        assert ids == original.encode(text).ids == theirs(text, add_special_tokens=False)["input_ids"], text
        assert ours.decode(ids) == text
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert ours.chat_template == CHAT_TEMPLATE
    generation = json.loads((tmp_path / "run" / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (0, 1)


def test_sentencepiece_tokenizer_matches_transformers(tmp_path):
    model = hf_model("llama")
    write_gguf(model, tmp_path / "model.gguf", tokenizer="spm")
    import_gguf(tmp_path / "model.gguf", tmp_path / "run")
    ours = load_tokenizer(tmp_path / "run")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="model.gguf", local_files_only=True)
    for text in ["the quick brown fox", "a fox", "thequick", "Ünïcödé 🙂", "the\nfox  brown"]:
        ids = ours.encode(text)
        assert ids == theirs(text, add_special_tokens=False)["input_ids"], text
        assert ours.decode(ids) == text
    assert ours.encode("the quick brown fox")[:3] == [ours.token_to_id("▁the"), ours.token_to_id("▁quick"),
                                                       ours.token_to_id("▁brown")]
    assert ours.backend.encode("the fox", add_special_tokens=True).ids[0] == 1  # add_bos_token default


def test_unsupported_tokenizer_model_is_named(tmp_path):
    write_gguf(hf_model("llama"), tmp_path / "model.gguf", tokenizer="bert")
    with pytest.raises(ConfigError, match="tokenizer model 'bert'"):
        import_gguf(tmp_path / "model.gguf", tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_unsupported_quant_type_is_named(tmp_path):
    write_gguf(hf_model("llama", **BIG), tmp_path / "model.gguf", qtype="TQ2_0")
    with pytest.raises(CheckpointError, match="TQ2_0, which is not supported"):
        import_gguf(tmp_path / "model.gguf", tmp_path / "run")


def test_corrupt_truncated_and_foreign_files_give_clear_errors(tmp_path):
    write_gguf(hf_model("llama"), tmp_path / "model.gguf")
    data = (tmp_path / "model.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 5000])
    with pytest.raises(CheckpointError, match="cut.gguf.*truncated"):
        import_gguf(tmp_path / "cut.gguf", tmp_path / "run")
    (tmp_path / "head.gguf").write_bytes(data[:200])
    with pytest.raises(CheckpointError, match="head.gguf is not a readable GGUF file"):
        import_gguf(tmp_path / "head.gguf", tmp_path / "run")
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(CheckpointError, match="is not a GGUF file"):
        import_gguf(tmp_path / "x.gguf", tmp_path / "run")


def test_unknown_architecture_is_named(tmp_path):
    model = hf_model("llama")
    write_gguf(model, tmp_path / "model.gguf", arch="falcon")
    with pytest.raises(ConfigError, match="architecture 'falcon'"):
        import_gguf(tmp_path / "model.gguf", tmp_path / "run")


@pytest.mark.parametrize("low,high,old_context", [(1.0, 4.0, 8192), (2.0, 8.0, 4096), (1.5, 3.0, 16384)])
def test_llama3_scaling_is_fitted_to_any_rope_freqs(low, high, old_context, tmp_path):
    """Whatever low/high/L0 produced llama.cpp's divisors, the recovered rope_scaling gives the same
    frequencies as llama.cpp applies: theta_i / rope_freqs[i]."""
    from tinyformer.components.rope import default_inv_freq, rope_inv_freq
    from tinyformer.config import ModelConfig
    from tinyformer.families.llama.gguf import llama3_scaling

    freqs = llama_cpp_rope_freqs(128, 500000.0, 8.0, low, high, old_context)
    scaling = llama3_scaling(freqs, 128, 500000.0, tmp_path / "x.gguf")
    cfg = ModelConfig(d_model=256, n_head=2, rope_theta=500000.0, rope_scaling=scaling)
    ours, _ = rope_inv_freq(cfg)
    torch.testing.assert_close(ours, default_inv_freq(128, 500000.0) / torch.from_numpy(freqs), rtol=1e-5, atol=0)
    with pytest.raises(ConfigError, match="rope_freqs"):
        llama3_scaling(freqs[::-1].copy(), 128, 500000.0, tmp_path / "x.gguf")


@pytest.mark.parametrize("qtype,kind", [("Q8_0", "int8"), ("Q4_0", "int4"), ("Q4_1", "int4")])
def test_keep_quant_holds_the_file_bits_and_matches_transformers(qtype, kind, tmp_path):
    """--keep-quant: the int8 / int4 run computes what transformers' dequantizing loader computes, and stores
    about the GGUF's bytes, not float32's."""
    from tinyformer.interop.gguf import import_gguf_keep_quant
    from tinyformer.run_folder import quant_spec

    write_gguf(hf_model("llama", **BIG), tmp_path / "model.gguf", qtype=qtype)
    report = import_gguf_keep_quant(tmp_path / "model.gguf", tmp_path / "run")
    spec = quant_spec(load_config(tmp_path / "run"))
    assert (spec.type, spec.group_size) == (kind, 32)
    assert not any("re-rounded into" in n for n in report.notes)
    # an untied token table stays float (a lookup reads one row); the rest holds about the GGUF's bytes
    stored = sum(t.numel() * t.element_size() for n, t in iter_tensors(tmp_path / "run") if n != "tok_emb.weight")
    assert stored < 1.5 * (tmp_path / "model.gguf").stat().st_size
    theirs = transformers_gguf(tmp_path)
    ids, mask = padded_batch()
    with torch.no_grad():
        logits = load_weight_only(tmp_path / "run")(ids, attention_mask=mask)[mask.bool()]
        default = load_model(tmp_path / "run")(ids, attention_mask=mask)[mask.bool()]
    ref = hf_logits(theirs, ids, mask)[mask.bool()]
    scale = ref.abs().max()
    torch.testing.assert_close(logits / scale, ref / scale, atol=1e-4, rtol=0)
    # the default kernel (8-bit activations where the CPU has integer dot products, as llama.cpp rounds them)
    # moves the logits by the rounding of each layer's inputs: up to a few hundredths of their range on this
    # random model (each layer's bound is tested in tests/components/test_quant_prefill.py)
    torch.testing.assert_close(default / scale, ref / scale, atol=5e-2, rtol=0)


def test_keep_quant_rounds_k_quants_into_int4_and_says_so(tmp_path):
    from tinyformer.interop.gguf import import_gguf_keep_quant

    write_gguf(hf_model("llama", **BIG), tmp_path / "model.gguf", qtype="Q4_K")
    report = import_gguf_keep_quant(tmp_path / "model.gguf", tmp_path / "run")
    assert any("Q4_K as int4" in n and "re-rounded" in n for n in report.notes)
    theirs = transformers_gguf(tmp_path)
    ids, mask = padded_batch()
    with torch.no_grad():
        logits = load_model(tmp_path / "run")(ids, attention_mask=mask)[mask.bool()]
    ref = hf_logits(theirs, ids, mask)[mask.bool()]
    rel = float((logits - ref).norm() / ref.norm())
    assert rel < 0.2, rel  # the int4 rounding of values already on a 4-bit grid, not an exact copy
