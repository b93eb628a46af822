"""Hugging Face folders <-> run folders, checked against transformers itself (random weights, offline)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from test_interop_common import (
    CHAT_TEMPLATE,
    SAMPLES,
    engine_greedy,
    greedy,
    hf_greedy,
    hf_logits,
    hf_model,
    padded_batch,
    pytestmark,  # noqa: F401 - one intra-op thread for every test here
    safetensors_dict,
    save_hf,
)

from tinyformer.config import ModelConfig
from tinyformer.errors import CheckpointError, ConfigError
from tinyformer.interop.hf_folder import export_hf, import_hf
from tinyformer.run_folder import load_config, load_model, load_tokenizer, save_model

transformers = pytest.importorskip("transformers")

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 10000.0}
CASES = {
    "llama-gqa-untied": ("llama", {}),
    "llama-mha-tied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama-bias": ("llama", dict(attention_bias=True, mlp_bias=True, num_key_value_heads=1)),
    "llama-linear": ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})),
    # max_position_embeddings 32 < prompt + 32 new tokens: the dynamic NTK base really grows
    "llama-dynamic": ("llama", dict(max_position_embeddings=32,
                                    rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})),
    "llama-yarn": ("llama", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 500000.0,
                                                  "original_max_position_embeddings": 16})),
    "llama3": ("llama", dict(rope_parameters=LLAMA3)),
    "mistral": ("mistral", dict(sliding_window=None)),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2-untied": ("qwen2", {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_import_gives_transformers_logits_and_greedy_tokens(case, tmp_path):
    kind, overrides = CASES[case]
    model = hf_model(kind, **overrides)
    save_hf(model, tmp_path / "hf", tokenizer=False)
    import_hf(tmp_path / "hf", tmp_path / "run")
    ours = load_model(tmp_path / "run")
    ids, mask = padded_batch()
    with torch.no_grad():
        logits = ours(ids, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(logits[real], hf_logits(model, ids, mask)[real], atol=1e-4, rtol=1e-4)
    want = hf_greedy(model, ids, mask, 32)
    if ours.cfg.rope_type == "dynamic":  # generates past the context: the engine refuses that, the plain loop not
        assert torch.equal(greedy(ours, ids, mask, 32), want)
    else:
        assert torch.equal(engine_greedy(ours, ids, mask, 32), want)


def test_transformers_4_config_spelling_is_read(tmp_path):
    """Llama 2 era config.json: rope_theta at the top level and rope_scaling with "type" (not rope_parameters)."""
    model = hf_model("llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 20000.0})
    save_hf(model, tmp_path / "hf", tokenizer=False)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config.pop("rope_parameters")
    config.update(rope_theta=20000.0, rope_scaling={"type": "linear", "factor": 2.0}, torch_dtype="float32")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    import_hf(tmp_path / "hf", tmp_path / "run")
    cfg = load_config(tmp_path / "run")
    assert (cfg.rope_theta, cfg.rope_scaling) == (20000.0, {"rope_type": "linear", "factor": 2.0})
    ids, mask = padded_batch()
    with torch.no_grad():
        ours = load_model(tmp_path / "run")(ids, attention_mask=mask)
    torch.testing.assert_close(ours[mask.bool()], hf_logits(model, ids, mask)[mask.bool()], atol=1e-4, rtol=1e-4)


def test_sharded_safetensors_import(tmp_path):
    model = hf_model("llama")
    save_hf(model, tmp_path / "hf", tokenizer=False, max_shard_size="30KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    import_hf(tmp_path / "hf", tmp_path / "run")
    ids, mask = padded_batch()
    with torch.no_grad():
        ours = load_model(tmp_path / "run")(ids, attention_mask=mask)
    torch.testing.assert_close(ours[mask.bool()], hf_logits(model, ids, mask)[mask.bool()], atol=1e-4, rtol=1e-4)


def test_pytorch_model_bin_import_single_and_sharded(tmp_path):
    model = hf_model("qwen2")
    model.config.save_pretrained(tmp_path / "one")
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save(sd, tmp_path / "one" / "pytorch_model.bin")
    model.config.save_pretrained(tmp_path / "two")
    names = sorted(sd)
    halves = {"pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
              "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
    for fname, keys in halves.items():
        torch.save({k: sd[k] for k in keys}, tmp_path / "two" / fname)
    index = {"metadata": {}, "weight_map": {k: f for f, keys in halves.items() for k in keys}}
    (tmp_path / "two" / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    ids, mask = padded_batch()
    want = hf_logits(model, ids, mask)[mask.bool()]
    for folder in ("one", "two"):
        import_hf(tmp_path / folder, tmp_path / f"run-{folder}")
        with torch.no_grad():
            ours = load_model(tmp_path / f"run-{folder}")(ids, attention_mask=mask)
        torch.testing.assert_close(ours[mask.bool()], want, atol=1e-4, rtol=1e-4)


class Payload:
    """Any non-tensor object in a pickle: torch.load(weights_only=True) must refuse to build it."""


def test_pickled_objects_in_pytorch_model_bin_are_refused(tmp_path):
    model = hf_model("llama")
    model.config.save_pretrained(tmp_path)
    torch.save({"model.embed_tokens.weight": torch.zeros(2), "payload": Payload()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="weights_only"):
        import_hf(tmp_path, tmp_path.parent / "out-pickle")


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_round_trip_is_bit_identical_with_identical_config(kind, tmp_path):
    model = hf_model(kind, tie_word_embeddings=(kind == "qwen2"),
                     rope_parameters=dict(LLAMA3) if kind == "llama" else None).to(torch.bfloat16)
    save_hf(model, tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "run")
    export_hf(tmp_path / "run", tmp_path / "hf2")
    before, after = safetensors_dict(tmp_path / "hf"), safetensors_dict(tmp_path / "hf2")
    assert before.keys() == after.keys()
    for name in before:
        assert before[name].dtype == after[name].dtype == torch.bfloat16, name
        assert torch.equal(before[name].view(torch.int16), after[name].view(torch.int16)), name
    a = transformers.AutoConfig.from_pretrained(tmp_path / "hf").to_dict()
    b = transformers.AutoConfig.from_pretrained(tmp_path / "hf2").to_dict()
    a.pop("_name_or_path"), b.pop("_name_or_path")
    assert a == b
    for fname in ("tokenizer.json", "generation_config.json"):
        assert json.loads((tmp_path / "hf" / fname).read_text()) == json.loads((tmp_path / "hf2" / fname).read_text())
    assert json.loads((tmp_path / "hf2" / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE


def test_export_loads_in_transformers_with_same_logits_and_tokens(tmp_path):
    model = hf_model("llama", tie_word_embeddings=True)
    save_hf(model, tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "run", dtype="float32")
    tok = load_tokenizer(tmp_path / "run")
    assert tok.chat_template == CHAT_TEMPLATE  # folded in from chat_template.jinja
    export_hf(tmp_path / "run", tmp_path / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out", local_files_only=True)
    for text in SAMPLES:
        assert hf_tok(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    ids, mask = padded_batch()
    with torch.no_grad():
        ours = load_model(tmp_path / "run")(ids, attention_mask=mask)
    torch.testing.assert_close(ours[mask.bool()], hf_logits(hf, ids, mask)[mask.bool()], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tokenizer_kind,arch", [("bpe", dict(n_kv_head=2, tie_embeddings=False)),
                                                 ("char", dict(attn_bias=True, tie_embeddings=True))])
def test_native_model_exports_to_transformers(tokenizer_kind, arch, tmp_path):
    """A model as `tinyformer train` writes it (DecoderLM + its own tokenizer) loads in transformers:
    same logits, same token ids, same special tokens, and generate() gives our greedy tokens."""
    from test_interop_common import TEXT

    from tinyformer.data.tokenizer import build_tokenizer
    from tinyformer.models.decoder import DecoderLM

    tok = build_tokenizer(tokenizer_kind, TEXT, vocab_size=300 if tokenizer_kind == "bpe" else None)
    tok.chat_template = CHAT_TEMPLATE
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=64, n_layer=2, n_head=4, d_ff=96, max_seq_len=64,
                      norm_eps=1e-6, rope_theta=10000.0, **arch)
    model = DecoderLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    run = tmp_path / "run"
    save_model(run, model)
    tok.save(run)
    report = export_hf(run, tmp_path / "hf")
    assert report.cfg == cfg
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    hf.generation_config.eos_token_id = None
    assert type(hf).__name__ == "LlamaForCausalLM"  # q/k/v-only biases: Llama with a zero o_proj bias
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert (hf_tok.bos_token, hf_tok.eos_token, hf_tok.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert hf.config.eos_token_id == tok.eos_id and hf.config.bos_token_id == tok.bos_id
    for text in ["the lazy dog", "def f(x):\n    return x"]:
        assert hf_tok(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    ids, mask = padded_batch(vocab=tok.vocab_size)
    real = mask.bool()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=mask)[real], hf_logits(hf, ids, mask)[real],
                                   atol=1e-4, rtol=1e-4)
    assert torch.equal(greedy(model, ids, mask, 16), hf_greedy(hf, ids, mask, 16))


def test_dtype_option_sets_stored_precision(tmp_path):
    save_hf(hf_model("mistral"), tmp_path / "hf", tokenizer=False)
    report = import_hf(tmp_path / "hf", tmp_path / "run", dtype="bfloat16")
    assert report.dtype == torch.bfloat16
    assert {t.dtype for t in safetensors_dict(tmp_path / "run").values()} == {torch.bfloat16}
    export_hf(tmp_path / "run", tmp_path / "hf16", dtype="float16")
    assert {t.dtype for t in safetensors_dict(tmp_path / "hf16").values()} == {torch.float16}
    assert json.loads((tmp_path / "hf16" / "config.json").read_text())["torch_dtype"] == "float16"


# ------------------------------------------------------------------------------------------------ errors


def _edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("changes,message", [
    (dict(model_type="falcon", architectures=["FalconForCausalLM"]), "'falcon'.*FalconForCausalLM"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "rope_type 'longrope'"),
    (dict(quantization_config={"quant_method": "gptq"}), "quantization_config.*gptq"),
    (dict(intermediate_size=80), r"mlp.gate_proj.weight has shape \[96, 64\], config.json implies \[80, 64\]"),
])
def test_unsupported_or_mismatched_configs_are_named(changes, message, tmp_path):
    save_hf(hf_model("llama"), tmp_path / "hf", tokenizer=False)
    _edit_config(tmp_path / "hf", **changes)
    with pytest.raises((ConfigError, CheckpointError), match=message):
        import_hf(tmp_path / "hf", tmp_path / "run")
    assert not (tmp_path / "run").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no staging folder left behind


def test_missing_and_unknown_tensors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    save_hf(hf_model("llama"), tmp_path / "hf", tokenizer=False)
    path = tmp_path / "hf" / "model.safetensors"
    sd = load_file(path)
    sd.pop("model.layers.1.mlp.up_proj.weight")
    save_file(sd, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) model.layers.1.mlp.up_proj.weight"):
        import_hf(tmp_path / "hf", tmp_path / "run")
    sd["model.layers.1.mlp.up_proj.weight"] = torch.zeros(96, 64)
    sd["model.layers.0.self_attn.q_norm.weight"] = torch.zeros(16)
    save_file(sd, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"unknown tensor\(s\) model.layers.0.self_attn.q_norm.weight"):
        import_hf(tmp_path / "hf", tmp_path / "run")


def test_corrupt_files_give_clear_errors(tmp_path):
    save_hf(hf_model("llama"), tmp_path / "hf", tokenizer=False)
    weights = tmp_path / "hf" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        import_hf(tmp_path / "hf", tmp_path / "run")
    weights.write_bytes(data)
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "llama", ')
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        import_hf(tmp_path / "hf", tmp_path / "run")
    (tmp_path / "hf" / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json does not exist"):
        import_hf(tmp_path / "hf", tmp_path / "run")


def test_output_folder_is_not_overwritten_without_force(tmp_path):
    save_hf(hf_model("llama"), tmp_path / "hf", tokenizer=False)
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(CheckpointError, match="not empty.*--force"):
        import_hf(tmp_path / "hf", out)
    assert (out / "keep.txt").read_text() == "precious"
    with pytest.raises(CheckpointError, match="keep.txt, which convert did not write"):
        import_hf(tmp_path / "hf", out, force=True)  # --force replaces a conversion's output, nothing else
    assert (out / "keep.txt").read_text() == "precious"
    (out / "keep.txt").unlink()
    import_hf(tmp_path / "hf", out)
    (out / "model.safetensors").write_bytes(b"an older conversion")
    import_hf(tmp_path / "hf", out, force=True)
    assert (out / "model.safetensors").read_bytes() != b"an older conversion"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(out).st_mode & 0o777 == 0o777 & ~umask  # not left with mkdtemp's private 0o700
