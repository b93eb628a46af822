"""Shared builders for the interop tests (random-weight HF models, a small BPE tokenizer, GGUF writing),
and the tests of the pieces under them: streaming safetensors I/O and the adapter registry."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tinyformer.errors import CheckpointError

transformers = pytest.importorskip("transformers")

TEXT = ("the quick brown fox jumps over the lazy dog. " * 20
        + "def f(x):\n    return x * 2\n" * 10 + "Ünïcödé text — with dashes, 123 numbers and emoji 🙂.\n" * 5)
CHAT_TEMPLATE = ("{% for m in messages %}{{ bos_token }}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ bos_token }}assistant:{% endif %}")
PYTHON_CLI = [sys.executable, "-m", "tinyformer"]
SAMPLES = ["the quick brown fox", "def f(x):\n    return x", "Ünïcödé 🙂 text", "  leading spaces", "<|eos|> tail"]


# tiny models: one intra-op thread (conftest.one_thread) for every test here
pytestmark = pytest.mark.usefixtures("one_thread")


def bpe_backend(vocab_size: int = 300):
    """A byte-level BPE trained on TEXT with ``tokenizers``; specials <|bos|>, <|eos|>, <|pad|> are ids 0-2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|bos|>", "<|eos|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT], trainer=trainer)
    return tok


def hf_tokenizer():
    """The BPE above wrapped as transformers' PreTrainedTokenizerFast, with a chat template."""
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe_backend(), bos_token="<|bos|>",
                                                eos_token="<|eos|>", pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


ARCH = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
}


def hf_model(kind: str = "llama", seed: int = 0, **overrides):
    """A random-weight transformers model; norms and biases perturbed so that a mis-mapping shows."""
    config_cls, model_cls = ARCH[kind]
    fields = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  bos_token_id=0, eos_token_id=1, pad_token_id=2)
    fields.update(overrides)
    torch.manual_seed(seed)
    config = config_cls(**fields)
    config._attn_implementation = "eager"  # the formula written out (Gemma 2's soft-capping needs it)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("mlp.gate.weight"):  # MoE routers: clear margins between experts, so that float
                p.normal_(0.0, 1.0)               # rounding cannot flip a top-k choice
    model.generation_config.eos_token_id = None  # generate exactly the requested number of tokens
    return model


def save_hf(model, folder: Path, tokenizer: bool = True, **kwargs) -> Path:
    model.save_pretrained(folder, **kwargs)
    if tokenizer:
        hf_tokenizer().save_pretrained(folder)
    return folder


def padded_batch(vocab: int = 320, length: int = 20, pad: int = 2, seed: int = 1):
    """Two rows, the second left-padded by 6 (as generate pads)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (2, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    ids[1, :6] = pad
    return ids, mask


def hf_logits(model, ids, mask):
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits


def greedy(model, ids: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy decoding with DecoderLM + KVCache: prefill the left-padded prompt, then one token a step."""
    cache = model.new_cache(ids.shape[0], max_len=ids.shape[1] + n)
    out = []
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, cache=cache, last_only=True)
        for _ in range(n):
            nxt = logits[:, -1].argmax(-1)
            out.append(nxt)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            logits = model(nxt[:, None], attention_mask=mask, cache=cache)
    return torch.stack(out, 1)


def engine_greedy(model, ids: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy decoding with tinyformer's generation engine (left-pads prompts of different lengths itself)."""
    from tinyformer.generation.generator import Generator
    from tinyformer.generation.sampling import SamplingParams

    generator = Generator(model)
    generator.eos_token_id = None  # exactly n tokens
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    results = generator.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=n))
    return torch.tensor([r.token_ids for r in results])


def hf_greedy(model, ids, mask, n: int) -> torch.Tensor:
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=2)
    return out[:, ids.shape[1]:]


def safetensors_dict(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


# ------------------------------------------------------------------------------------------------ GGUF writing

def permute_for_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation (written independently of the importer's inverse)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}

GEMMA_GGUF_NAMES = {**GGUF_NAMES, "post_attention_layernorm": "post_attention_norm",
                    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}

# byte offsets of the float16 scales inside one block, so random blocks get sane magnitudes
_SCALE_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,),
                  "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,)}


def random_blocks(rows: int, cols: int, qtype_name: str, seed: int = 0) -> np.ndarray:
    """Raw random blocks of a ggml quantization (the Python gguf package cannot quantize K-quants), with
    every float16 scale set to a small value so that dequantized weights are O(0.1)."""
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, qtype_name)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for off in _SCALE_OFFSETS[qtype_name]:
        scales = rng.uniform(0.0005, 0.003, size=(rows, cols // block)).astype(np.float16)
        raw[:, :, off:off + 2] = scales.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, cols // block * size)


def spm_vocab(vocab_size: int) -> tuple[list[str], list[float], list[int]]:
    """A llama.cpp SentencePiece ('llama') vocabulary: <unk>, <s>, </s>, the 256 byte tokens, then pieces
    scored so that pieces listed earlier merge first; tokens, scores and token types."""
    pieces = ["▁", "t", "h", "e", "q", "u", "i", "c", "k", "a", "b", "o", "w", "n", "r", "x", "f", "s",
              "▁t", "he", "▁q", "ck", "▁b", "ow", "▁f", "ox", "▁a", "▁the", "▁qu", "ick", "▁br", "own", "▁fox",
              "▁quick", "▁brown"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    unused = vocab_size - len(tokens)
    tokens += [f"<extra_{i}>" for i in range(unused)]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [-1e4] * unused
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [5] * unused
    return tokens, scores, types


def write_gguf_shape(w, cfg) -> None:
    """The size keys llama.cpp's converter writes from a transformers config (widths, heads, context, norm epsilon,
    the (global layers') RoPE base, head_dim as key/value length)."""
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)  # Gemma 3: the global layers' RoPE
    w.add_rope_freq_base(rope["rope_theta"])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(cfg.vocab_size)


def write_gguf_bpe_tokenizer(w, vocab_size: int) -> None:
    """The tokenizer metadata of hf_tokenizer() as llama.cpp writes a byte-level BPE ('gpt2'), with its chat
    template; the vocabulary padded to ``vocab_size`` with unused tokens."""
    backend = bpe_backend()
    vocab = backend.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in ("<|bos|>", "<|eos|>", "<|pad|>") else 1 for t in tokens])
    merges = json.loads(backend.to_str())["model"]["merges"]
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


def write_gguf(model, path: Path, qtype: str = "F32", arch: str = "llama", tokenizer: str | None = "gpt2",
               rope_scaling: dict | None = None, rope_freqs: np.ndarray | None = None, name: str = "tiny") -> None:
    """Write ``model`` as llama.cpp's converter would: GGUF names, q/k permuted for 'llama', 2-D weights in
    ``qtype`` (float types and Q8_0/Q4_0/Q4_1 quantized from the weights; K-quants as random blocks),
    norms and biases in F32, and the tokenizer metadata of hf_tokenizer()."""
    import gguf

    Q = gguf.GGMLQuantizationType
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    write_gguf_shape(w, cfg)
    if getattr(cfg, "sliding_window", None) and arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
    if rope_scaling:
        w.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling["type"]))
        w.add_rope_scaling_factor(rope_scaling["factor"])
        if "original" in rope_scaling:
            w.add_rope_scaling_orig_ctx_len(rope_scaling["original"])
    if tokenizer == "gpt2":
        write_gguf_bpe_tokenizer(w, cfg.vocab_size)
    elif tokenizer == "spm":
        tokens, scores, types = spm_vocab(cfg.vocab_size)
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_space_prefix(True)
    elif tokenizer is not None:
        w.add_tokenizer_model(tokenizer)
        w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    seed = 0
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        gname = top.get(hf_name)
        if gname is None:
            layer, rest = hf_name.removeprefix("model.layers.").split(".", 1)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{(GEMMA_GGUF_NAMES if arch == 'gemma3' else GGUF_NAMES)[module]}.{kind}"
        a = tensor.float().numpy()
        if arch == "gemma3" and hf_name.endswith("norm.weight"):  # llama.cpp stores Gemma's gains as 1 + g
            a = a + 1
        if arch == "llama" and ".attn_q." in gname:
            a = permute_for_gguf(a, cfg.num_attention_heads)
        if arch == "llama" and ".attn_k." in gname:
            a = permute_for_gguf(a, cfg.num_key_value_heads)
        if a.ndim == 1 or qtype == "F32":
            w.add_tensor(gname, np.ascontiguousarray(a, dtype=np.float32))
        elif qtype == "F16":
            w.add_tensor(gname, a.astype(np.float16))
        elif qtype in ("BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "TQ2_0"):
            q = gguf.quants.quantize(a, getattr(Q, qtype))
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=getattr(Q, qtype))
        else:
            seed += 1
            q = random_blocks(a.shape[0], a.shape[1], qtype, seed)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=getattr(Q, qtype))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama_cpp_rope_freqs(head_dim: int, theta: float, factor: float, low: float, high: float,
                         old_context: int) -> np.ndarray:
    """The rope_freqs tensor llama.cpp's converter writes for llama3 RoPE scaling."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old_context / high:
            out.append(1.0)
        elif wavelen > old_context / low:
            out.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


# ------------------------------------------------------------------------------------------------ tests

def test_streaming_safetensors_writer_is_read_by_the_safetensors_library(tmp_path):
    from safetensors.torch import load_file

    from tinyformer.safetensors_io import TensorSpec, write_planned

    tensors = [("a", torch.randn(3, 5)), ("b", torch.randn(7).to(torch.bfloat16)), ("c", torch.arange(4)),
               ("d", torch.randn(2, 2).half()), ("e", torch.tensor(1.5))]
    specs = [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors]
    files = write_planned(tmp_path, specs, iter(tensors), max_shard_bytes=40)
    assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    loaded = {}
    for f in files:
        loaded.update(load_file(tmp_path / f))
    assert set(index["weight_map"]) == set(loaded) == {n for n, _ in tensors}
    for name, t in tensors:
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t)


def test_safetensors_reader_matches_the_library_and_rejects_truncation(tmp_path):
    from safetensors.torch import save_file

    from tinyformer.safetensors_io import SafetensorsFile

    tensors = {"x": torch.randn(4, 8), "y": torch.randn(3).to(torch.bfloat16), "z": torch.ones(2, dtype=torch.int64)}
    save_file(tensors, tmp_path / "m.safetensors")
    f = SafetensorsFile(tmp_path / "m.safetensors")
    for name, t in tensors.items():
        assert torch.equal(f.read(name), t) and f.meta(name).shape == t.shape
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match="truncated"):
        SafetensorsFile(tmp_path / "cut.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(CheckpointError, match="corrupt"):
        SafetensorsFile(tmp_path / "junk.safetensors")


def test_a_registered_adapter_handles_its_model_type(tmp_path):
    """The registry is pluggable: an adapter registered for a new model_type is picked for import."""
    from tinyformer.families import ADAPTERS, register_adapter
    from tinyformer.families.adapter import Adapter
    from tinyformer.families.llama.hf import LAYOUT as llama
    from tinyformer.interop.hf_folder import import_hf
    from tinyformer.run_folder import load_model

    model = hf_model("llama")
    save_hf(model, tmp_path / "hf", tokenizer=False)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["model_type"] = "toy_llama"
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    toy = Adapter(name="toy", model_types=("toy_llama",),
                  config_from_hf=lambda hf: llama.config_from_hf({**hf, "model_type": "llama"}),
                  config_to_hf=llama.config_to_hf, hf_to_tinyformer=llama.hf_to_tinyformer,
                  tinyformer_to_hf=llama.tinyformer_to_hf, export_problem=lambda cfg: "toy exports nothing")
    register_adapter(toy)
    try:
        import_hf(tmp_path / "hf", tmp_path / "run")
    finally:
        ADAPTERS.pop("toy_llama")
    ids, mask = padded_batch()
    with torch.no_grad():
        ours = load_model(tmp_path / "run")(ids, attention_mask=mask)
    torch.testing.assert_close(ours[mask.bool()], hf_logits(model, ids, mask)[mask.bool()], atol=1e-4, rtol=1e-4)


def assert_import_matches_transformers(kind: str, folder: Path, length: int = 20, new_tokens: int = 8,
                                       **overrides):
    """A random transformers model of ``kind`` imported into ``folder``/run must give transformers' logits on
    a left-padded batch, the same logits when decoded one token at a time through the KV cache, the tokens
    of transformers' ``generate`` (plain cache loop and the engine), and export back to identical tensors.
    Returns (transformers model, tinyformer model)."""
    from tinyformer.interop.hf_folder import export_hf, import_hf
    from tinyformer.run_folder import load_model

    hf = hf_model(kind, **overrides)
    save_hf(hf, folder / "hf", tokenizer=False)
    import_hf(folder / "hf", folder / "run")
    ours = load_model(folder / "run")
    ids, mask = padded_batch(length=length)
    real = mask.bool()
    with torch.no_grad():
        logits = ours(ids, attention_mask=mask)
        torch.testing.assert_close(logits[real], hf_logits(hf, ids, mask)[real], atol=1e-4, rtol=1e-4)
        cache = ours.new_cache(2, length)
        steps = [ours(ids[:, :3], attention_mask=mask[:, :3], cache=cache)]
        steps += [ours(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache) for t in range(3, length)]
        torch.testing.assert_close(torch.cat(steps, 1)[real], logits[real], atol=1e-5, rtol=1e-5)
    want = hf_greedy(hf, ids, mask, new_tokens)
    assert torch.equal(greedy(ours, ids, mask, new_tokens), want)
    assert torch.equal(engine_greedy(ours, ids, mask, new_tokens), want)
    export_hf(folder / "run", folder / "hf2")
    before, after = safetensors_dict(folder / "hf"), safetensors_dict(folder / "hf2")
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name
    return hf, ours
