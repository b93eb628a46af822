"""Sliding-window attention: the window mask, the rolling (W-slot) KV cache, and parity with transformers'
Mistral and Qwen2 (use_sliding_window) beyond the window."""

from __future__ import annotations

import json

import pytest
import torch
from test_interop_common import (
    assert_import_matches_transformers,
    hf_greedy,
    hf_model,
    padded_batch,
    pytestmark,  # noqa: F401 - one intra-op thread for every test here
    save_hf,
)

from tinyformer.config import ModelConfig
from tinyformer.errors import ConfigError
from tinyformer.interop.hf_folder import import_hf
from tinyformer.models.decoder import DecoderLM
from tinyformer.run_folder import load_config, load_model

W = 6


def tiny(**overrides) -> DecoderLM:
    fields = dict(vocab_size=64, d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=48, max_seq_len=64,
                  sliding_window=W)
    fields.update(overrides)
    torch.manual_seed(0)
    return DecoderLM(ModelConfig(**fields)).eval()


@pytest.mark.parametrize("impl", ["sdpa", "reference"])
def test_one_layer_output_depends_only_on_the_last_w_tokens(impl):
    """Query i sees keys j with i - W < j <= i: changing any earlier token leaves position i unchanged,
    changing token i - W + 1 does not."""
    model = tiny(n_layer=1, attn_impl=impl)
    x = torch.randint(0, 64, (1, 20))
    i = 15
    with torch.no_grad():
        base = model(x)[0, i]
        before = x.clone()
        before[0, : i - W + 1] = (before[0, : i - W + 1] + 1) % 64
        inside = x.clone()
        inside[0, i - W + 1] = (inside[0, i - W + 1] + 1) % 64
        torch.testing.assert_close(model(before)[0, i], base, atol=1e-6, rtol=0)
        assert not torch.allclose(model(inside)[0, i], base, atol=1e-4)


@pytest.mark.parametrize("layer_types", [None, ["full", "sliding"]])
@pytest.mark.parametrize("impl", ["sdpa", "reference"])
def test_rolling_cache_equals_full_cache_and_full_forward_over_three_windows(layer_types, impl):
    model = tiny(layer_types=layer_types, attn_impl=impl)
    T = 3 * W
    ids, mask = padded_batch(vocab=64, length=T)
    rolling, full = model.new_cache(2, T), model.new_cache(2, T, rolling=False)
    slides = [i for i in range(2) if model.cfg.layer_window(i)]
    assert all(rolling.rolling[i] and rolling.layers[i][0].shape[2] == W for i in slides)
    assert not any(full.rolling) and full.nbytes() > rolling.nbytes()
    with torch.no_grad():
        whole = model(ids, attention_mask=mask)
        # prefill in chunks of 4, 1 and 5 tokens, then one token at a time
        outs = {"rolling": [], "full": []}
        for name, cache in (("rolling", rolling), ("full", full)):
            for a, b in [(0, 4), (4, 5), (5, 10)] + [(t, t + 1) for t in range(10, T)]:
                outs[name].append(model(ids[:, a:b], attention_mask=mask[:, :b], cache=cache))
    real = mask.bool()
    for name in outs:
        torch.testing.assert_close(torch.cat(outs[name], 1)[real], whole[real], atol=1e-5, rtol=1e-5)


def test_per_row_decoding_with_rolling_cache_equals_full_forward():
    """The compiled decode step's path (cache.at(positions): every row at its own position)."""
    model = tiny(layer_types=["sliding", "full"])
    T = 3 * W
    x = torch.randint(0, 64, (2, T))
    cache = model.new_cache(2, T + 1)
    with torch.no_grad():
        whole = model(x)
        model(x[:1, :3], cache=cache.row_view(0))
        model(x[1:, :5], cache=cache.row_view(1))
        pos = torch.tensor([3, 5])
        for _ in range(T - 5):
            step = model(x[torch.arange(2), pos][:, None], cache=cache.at(pos))
            for b in range(2):
                torch.testing.assert_close(step[b, 0], whole[b, int(pos[b])], atol=1e-5, rtol=1e-5)
            pos = pos + 1


def test_count_of_the_kv_cache_equals_the_rolling_cache_bytes():
    from tinyformer.sizing import sizing_report

    model = tiny(layer_types=["full", "sliding"])
    report = sizing_report(model.cfg, seq_len=40, batch=2, dtype="float32")
    assert report["kv_cache"]["bytes_total"] == model.new_cache(2, 40).nbytes()
    # the attention term of the training FLOPs: the full layer attends to 40 keys, the sliding one to W
    full = sizing_report(model.cfg.replace(sliding_window=None, layer_types=None), seq_len=40)
    attention = 12 * model.cfg.n_head * model.cfg.head_dim
    assert full["training_flops_per_token"] - report["training_flops_per_token"] == attention * (40 - W)


def test_window_fields_are_validated():
    with pytest.raises(ConfigError, match="sliding_window must be a positive"):
        ModelConfig(sliding_window=0)
    with pytest.raises(ConfigError, match="layer_types must be a list of 4"):
        ModelConfig(sliding_window=8, layer_types=["sliding"])
    with pytest.raises(ConfigError, match="'local' is not one of"):
        ModelConfig(sliding_window=8, layer_types=["local"] * 4)
    with pytest.raises(ConfigError, match="sliding_window is not set"):
        ModelConfig(layer_types=["sliding"] * 4)


HF_CASES = {
    "mistral": ("mistral", dict(sliding_window=W)),
    # layer 0 full, layer 1 sliding (transformers derives layer_types from max_window_layers)
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=W, max_window_layers=1)),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_import_matches_transformers_beyond_the_window(case, tmp_path):
    kind, overrides = HF_CASES[case]
    assert_import_matches_transformers(kind, tmp_path, length=4 * W, new_tokens=2 * W, **overrides)
    cfg = load_config(tmp_path / "run")
    assert (cfg.sliding_window, cfg.max_seq_len) == (W, 64)
    assert cfg.layer_types == (["full", "sliding"] if kind == "qwen2" else None)
    config = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert (config["sliding_window"], config["max_position_embeddings"]) == (W, 64)


def test_slide_policy_past_the_window_equals_transformers(tmp_path):
    """The old import capped a windowed model's context to its window, so `--context-policy slide` re-prefilled
    from the window on and diverged from transformers; the context is now the model's own."""
    from tinyformer.generation.generator import Generator
    from tinyformer.generation.sampling import SamplingParams

    hf = hf_model("mistral", sliding_window=W)
    save_hf(hf, tmp_path / "hf", tokenizer=False)
    import_hf(tmp_path / "hf", tmp_path / "run")
    generator = Generator(load_model(tmp_path / "run"), context_policy="slide")
    generator.eos_token_id = None
    ids, mask = padded_batch(length=2 * W)
    prompt = ids[:1]
    out = generator.generate([prompt[0].tolist()], SamplingParams(temperature=0.0, max_new_tokens=3 * W))
    assert out[0].token_ids == hf_greedy(hf, prompt, mask[:1], 3 * W)[0].tolist()


def test_fresh_windowed_models_export_as_mistral_or_qwen2(tmp_path):
    from tinyformer.families import config_to_hf
    from tinyformer.families.llama.hf import layout_problem

    assert config_to_hf(tiny().cfg)["model_type"] == "mistral"
    qwen2 = config_to_hf(tiny(attn_bias=True, layer_types=["full", "sliding"]).cfg)
    assert (qwen2["model_type"], qwen2["layer_types"]) == ("qwen2", ["full_attention", "sliding_attention"])
    assert "per-layer pattern" in layout_problem(tiny(layer_types=["full", "sliding"]).cfg)


@pytest.mark.slow
def test_compiled_decode_step_with_rolling_cache_equals_eager():
    from test_engine import PROMPTS, id_generator, random_lm

    from tinyformer.generation.sampling import SamplingParams

    model = random_lm(dtype=torch.float32, sliding_window=4, layer_types=["sliding", "full"])
    params = SamplingParams(temperature=0, max_new_tokens=12)
    want = [r.token_ids for r in id_generator(model).generate(PROMPTS, params)]
    assert [r.token_ids for r in id_generator(model, compile=True).generate(PROMPTS, params)] == want
