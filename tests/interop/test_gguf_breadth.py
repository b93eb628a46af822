"""GGUF import of Phi-3, Gemma 2, Mixtral and Qwen3-MoE files, written here with the gguf package the way
llama.cpp's converter lays them out: tensor names from gguf's own TensorNameMap, q/k rows permuted for 'llama',
Gemma's norm gains stored as 1 + g, Phi-3's fused attn_qkv and gate-up ffn_up, experts stacked as ffn_*_exps (or,
as older files have them, one tensor per expert), the router in F32, LongRoPE as rope_factors_* tensors.

References. transformers' GGUF loader (``from_pretrained(dir, gguf_file=...)``) where it reads everything the file
says: Phi-3 without LongRoPE or a window, Gemma 2 with its config class's defaults (query_pre_attn_scalar 256,
soft-caps 50 / 30, every 2nd layer global), Qwen3-MoE with renormalised top-k weights. Where it does not -- it reads
neither Phi-3's LongRoPE tensors nor its window, nor Gemma 2's soft-caps and attention.scale, nor
expert_weights_norm, and it loads a 'llama' file with experts (Mixtral) as a dense Llama -- the reference is the
transformers model the file was written from, holding the weights the file holds (every quantized matrix
dequantized by gguf.quants, independently of the importer). Logits agree within 1e-4 of the logit scale, on left-
padded prompts longer than every sliding window (and than Phi-3's original context, where LongRoPE switches).
The export tests write runs imported from such models with ``export_gguf`` and read the files back with the importer
and, where it reads the architecture, with transformers' loader.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from quant_helpers import load_weight_only
from test_interop_common import (
    hf_logits,
    hf_model,
    padded_batch,
    permute_for_gguf,
    pytestmark,  # noqa: F401 - one intra-op thread for every test here
    write_gguf_bpe_tokenizer,
    write_gguf_shape,
)

from tinyformer.errors import CheckpointError, ConfigError
from tinyformer.interop.gguf import import_gguf, import_gguf_keep_quant
from tinyformer.run_folder import iter_tensors, load_config, load_model, quant_spec

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers' GGUF loader requires it

W = 6  # sliding window, shorter than every prompt here
L0 = 32  # Phi-3's original context in the LongRoPE case
g = torch.Generator().manual_seed(5)
LONGROPE = dict(max_position_embeddings=128, original_max_position_embeddings=L0,
                rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                 "short_factor": (1 + torch.rand(8, generator=g)).tolist(),
                                 "long_factor": (1 + 8 * torch.rand(8, generator=g)).tolist()})
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
QWEN3_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)


def write_file(model, path: Path, arch: str, qtype: str = "F32", experts: str = "stacked",
               meta: dict | None = None, attn_factor: float | None = None,
               skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Write ``model`` as a GGUF file of ``arch``; return the HF state dict the file holds (quantized matrices as
    gguf.quants dequantizes them; norms as (1 + g) - 1 for Gemma, in float32)."""
    from gguf.constants import MODEL_ARCH_NAMES

    Q = gguf.GGMLQuantizationType
    cfg = model.config
    names = gguf.get_tensor_name_map(next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch),
                                     cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    write_gguf_shape(w, cfg)
    for key, value in (meta or {}).items():
        getattr(w, f"add_{key}")(value)
    write_gguf_bpe_tokenizer(w, cfg.vocab_size)

    held: dict[str, np.ndarray] = {}

    def put(gname: str, a: np.ndarray, quantize: bool = True, n_head: int = 0) -> np.ndarray:
        """Store ``a`` (permuted for llama's RoPE when n_head); return what a reader gets back, unpermuted."""
        a = np.ascontiguousarray(a, dtype=np.float32)
        stored = permute_for_gguf(a, n_head) if n_head else a
        if a.ndim == 1 or qtype == "F32" or not quantize:
            w.add_tensor(gname, np.ascontiguousarray(stored))
            return a
        q = gguf.quants.quantize(np.ascontiguousarray(stored), getattr(Q, qtype))
        w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=getattr(Q, qtype))
        return gguf.quants.dequantize(gguf.quants.quantize(a, getattr(Q, qtype)), getattr(Q, qtype))

    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        a = tensor.float().numpy()
        layer = hf_name.removeprefix("model.layers.").split(".")[0]
        if hf_name.endswith("experts.gate_up_proj") or hf_name.endswith("experts.down_proj"):
            parts = ("gate", "up") if "gate_up" in hf_name else ("down",)
            out = []
            for part, block in zip(parts, np.split(a, len(parts), axis=1)):
                if experts == "stacked":
                    out.append(put(f"blk.{layer}.ffn_{part}_exps.weight", block))
                else:
                    out.append(np.stack([put(f"blk.{layer}.ffn_{part}.{e}.weight", x) for e, x in enumerate(block)]))
            held[hf_name] = np.concatenate(out, axis=1)
            continue
        module, kind = hf_name.rsplit(".", 1)
        gname = f"{names.get_name(module)}.{kind}"
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):  # llama.cpp stores Gemma's 1 + g
            w.add_tensor(gname, a + 1)
            held[hf_name] = (a + 1) - np.float32(1)
            continue
        n_head = 0
        if arch == "llama" and ".attn_q." in gname:
            n_head = cfg.num_attention_heads
        elif arch == "llama" and ".attn_k." in gname:
            n_head = cfg.num_key_value_heads
        held[hf_name] = put(gname, a, quantize=".ffn_gate_inp." not in gname, n_head=n_head)  # router: F32
    rope = cfg.rope_parameters
    if rope.get("rope_type") == "longrope":  # llama.cpp's Phi-3 converter
        derived = np.sqrt(1 + np.log(cfg.max_position_embeddings / L0) / np.log(L0))
        w.add_rope_scaling_attn_factors(float(attn_factor or derived))
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        for which in ("long", "short"):
            if f"rope_factors_{which}.weight" not in skip:
                w.add_tensor(f"rope_factors_{which}.weight", np.array(rope[f"{which}_factor"], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in held.items()}


def holding(model, held: dict[str, torch.Tensor]):
    """The model with the weights the file holds."""
    ref = copy.deepcopy(model)
    missing, unexpected = ref.load_state_dict(held, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return ref.eval()


def transformers_gguf(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf", local_files_only=True,
                                                             dtype=torch.float32).eval()


def assert_logits_match(run: Path, reference, length: int = 24, atol: float = 1e-4) -> None:
    ids, mask = padded_batch(length=length)
    with torch.no_grad():
        ours = load_weight_only(run, dtype=torch.float32)(ids, attention_mask=mask)
    ref = hf_logits(reference, ids, mask)
    real = mask.bool()
    scale = ref[real].abs().max()
    torch.testing.assert_close(ours[real] / scale, ref[real] / scale, atol=atol, rtol=0)


# ------------------------------------------------------------------------------------------------ Phi-3


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_phi3_gguf_matches_transformers_gguf_loader(qtype, tmp_path):
    model = hf_model("phi3")
    held = write_file(model, tmp_path / "model.gguf", "phi3", qtype, meta={"sliding_window": 0})
    import_gguf(tmp_path / "model.gguf", tmp_path / "run")
    cfg = load_config(tmp_path / "run")
    assert (cfg.sliding_window, cfg.rope_type, cfg.n_kv_head) == (None, "default", 2)
    assert_logits_match(tmp_path / "run", transformers_gguf(tmp_path))
    assert_logits_match(tmp_path / "run", holding(model, held))


@pytest.mark.parametrize("qtype", ["F32", "Q4_0"])
def test_phi3_gguf_longrope_and_window_match_the_source_model(qtype, tmp_path):
    """transformers' GGUF loader reads neither rope_factors_* nor Phi-3's window: the reference is the source model.
    Prompts of L0 + 8 positions use the long factors; the window (6) is shorter than every prompt."""
    model = hf_model("phi3", sliding_window=W, **LONGROPE)
    held = write_file(model, tmp_path / "model.gguf", "phi3", qtype, meta={"sliding_window": W})
    import_gguf(tmp_path / "model.gguf", tmp_path / "run")
    cfg = load_config(tmp_path / "run")
    assert (cfg.sliding_window, cfg.layer_types, cfg.rope_type) == (W, None, "longrope")
    assert cfg.rope_scaling["original_max_position_embeddings"] == L0
    assert "attention_factor" not in cfg.rope_scaling  # the file's equals the derived sqrt(1 + ln f / ln L0)
    assert cfg.rope_scaling["long_factor"] == pytest.approx(LONGROPE["rope_parameters"]["long_factor"], rel=1e-6)
    reference = holding(model, held)
    assert_logits_match(tmp_path / "run", reference, length=24)
    assert_logits_match(tmp_path / "run", reference, length=L0 + 8)


def test_phi3_longrope_attention_factor_from_metadata_and_missing_factors(tmp_path):
    """A stated attn_factor that is not the derived one becomes attention_factor (the source model has it too);
    a file with one of the two factor tensors is refused."""
    params = {**LONGROPE["rope_parameters"], "attention_factor": 1.25}
    model = hf_model("phi3", **{**LONGROPE, "rope_parameters": params})
    held = write_file(model, tmp_path / "model.gguf", "phi3", attn_factor=1.25)
    import_gguf(tmp_path / "model.gguf", tmp_path / "run")
    assert load_config(tmp_path / "run").rope_scaling["attention_factor"] == 1.25
    assert_logits_match(tmp_path / "run", holding(model, held), length=L0 + 8)
    write_file(model, tmp_path / "half.gguf", "phi3", skip=("rope_factors_short.weight",))
    with pytest.raises(CheckpointError, match="rope_factors_short.weight is missing"):
        import_gguf(tmp_path / "half.gguf", tmp_path / "half")


# ------------------------------------------------------------------------------------------------ Gemma 2


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gemma2_gguf_matches_transformers_gguf_loader(qtype, tmp_path):
    """transformers' loader takes query_pre_attn_scalar (256), the soft-caps (50, 30) and the alternating pattern
    from Gemma2Config's defaults: the model has them too, and the file states the soft-caps."""
    model = hf_model("gemma2", num_attention_heads=2, num_key_value_heads=1, head_dim=256, sliding_window=W,
                     query_pre_attn_scalar=256, tie_word_embeddings=True)
    held = write_file(model, tmp_path / "model.gguf", "gemma2", qtype,
                      meta={"sliding_window": W, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0})
    import_gguf(tmp_path / "model.gguf", tmp_path / "run")
    cfg = load_config(tmp_path / "run")
    assert (cfg.sliding_window, cfg.layer_types, cfg.norm_placement, cfg.qk_norm) == (W, ["sliding", "full"],
                                                                                      "sandwich", False)
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap, cfg.norm_gain_offset) == (50.0, 30.0, 1.0)
    assert_logits_match(tmp_path / "run", transformers_gguf(tmp_path))
    assert_logits_match(tmp_path / "run", holding(model, held))


def test_gemma2_gguf_soft_caps_and_attention_scale_come_from_metadata(tmp_path):
    """Soft-caps small enough to bend these weights, and a score scale that is not head_dim^-1/2, stated as
    attention.scale: transformers' loader reads neither, so the reference is the source model."""
    model = hf_model("gemma2", head_dim=16, sliding_window=W, query_pre_attn_scalar=24, tie_word_embeddings=True,
                     attn_logit_softcapping=0.5, final_logit_softcapping=0.1)
    held = write_file(model, tmp_path / "model.gguf", "gemma2",
                      meta={"sliding_window": W, "attn_logit_softcapping": 0.5, "final_logit_softcapping": 0.1,
                            "attention_scale": 24 ** -0.5})
    import_gguf(tmp_path / "model.gguf", tmp_path / "run")
    cfg = load_config(tmp_path / "run")
    assert cfg.attn_scale == pytest.approx(24 ** -0.5, rel=1e-6)
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (0.5, 0.1)
    assert_logits_match(tmp_path / "run", holding(model, held))
    ids, mask = padded_batch()
    with torch.no_grad():
        assert load_model(tmp_path / "run")(ids, attention_mask=mask).abs().max() < 0.1  # the final cap applied


# ------------------------------------------------------------------------------------------------ MoE


@pytest.mark.parametrize("qtype,experts", [("F32", "stacked"), ("Q8_0", "stacked"), ("F32", "per-expert"),
                                           ("Q4_1", "per-expert")])
def test_mixtral_gguf_matches_the_source_model(qtype, experts, tmp_path):
    """A 'llama' file with expert_count: Mixtral (transformers' GGUF loader builds a dense Llama from it, so the
    reference is the source MixtralForCausalLM). Stacked ffn_*_exps and older per-expert tensors alike."""
    model = hf_model("mixtral", **MOE)
    held = write_file(model, tmp_path / "model.gguf", "llama", qtype, experts,
                      meta={"expert_count": 4, "expert_used_count": 2})
    import_gguf(tmp_path / "model.gguf", tmp_path / "run")
    cfg = load_config(tmp_path / "run")
    assert (cfg.ffn, cfg.n_experts, cfg.experts_per_token, cfg.router_norm_topk, cfg.qk_norm) == ("moe", 4, 2, True,
                                                                                                  False)
    assert cfg.extra["hf_config"]["model_type"] == "mixtral"
    assert_logits_match(tmp_path / "run", holding(model, held))


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_qwen3_moe_gguf_matches_transformers_gguf_loader(qtype, tmp_path):
    """transformers' loader takes moe_intermediate_size from Qwen3MoeConfig's default (768), not from
    expert_feed_forward_length: the model has that width (the file's feed_forward_length is the dense 96)."""
    model = hf_model("qwen3_moe", **{**QWEN3_MOE, "moe_intermediate_size": 768})
    held = write_file(model, tmp_path / "model.gguf", "qwen3moe", qtype,
                      meta={"expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 768})
    import_gguf(tmp_path / "model.gguf", tmp_path / "run")
    cfg = load_config(tmp_path / "run")
    assert (cfg.ffn, cfg.n_experts, cfg.d_ff, cfg.router_norm_topk, cfg.qk_norm) == ("moe", 4, 768, True, True)
    assert_logits_match(tmp_path / "run", transformers_gguf(tmp_path))
    assert_logits_match(tmp_path / "run", holding(model, held))


def test_qwen3_moe_expert_weights_norm_false_keeps_softmax_weights(tmp_path):
    """expert_weights_norm = false: the top-k softmax weights are not renormalised (norm_topk_prob False); the
    reference is the source model, since transformers' loader always renormalises."""
    model = hf_model("qwen3_moe", **{**QWEN3_MOE, "norm_topk_prob": False})
    held = write_file(model, tmp_path / "model.gguf", "qwen3moe",
                      meta={"expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 32,
                            "expert_weights_norm": False})
    import_gguf(tmp_path / "model.gguf", tmp_path / "run")
    assert not load_config(tmp_path / "run").router_norm_topk
    assert_logits_match(tmp_path / "run", holding(model, held))


def test_shared_experts_and_other_gating_are_refused(tmp_path):
    model = hf_model("qwen3_moe", **QWEN3_MOE)
    write_file(model, tmp_path / "a.gguf", "qwen3moe",
               meta={"expert_count": 4, "expert_used_count": 2, "expert_shared_count": 1})
    with pytest.raises(ConfigError, match="shared experts"):
        import_gguf(tmp_path / "a.gguf", tmp_path / "run")
    write_file(model, tmp_path / "b.gguf", "qwen3moe",
               meta={"expert_count": 4, "expert_used_count": 2,
                     "expert_gating_func": gguf.ExpertGatingFuncType.SIGMOID})
    with pytest.raises(ConfigError, match="expert_gating_func=2"):
        import_gguf(tmp_path / "b.gguf", tmp_path / "run")
    write_file(hf_model("mixtral", **MOE), tmp_path / "c.gguf", "llama",
               meta={"expert_count": 3, "expert_used_count": 2})
    with pytest.raises(CheckpointError, match="not 3 stacked experts"):
        import_gguf(tmp_path / "c.gguf", tmp_path / "run")
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------------ --keep-quant


@pytest.mark.parametrize("kind,qtype", [("phi3", "Q8_0"), ("gemma2", "Q4_0")])
def test_keep_quant_holds_the_bits_of_fused_and_gemma_files(kind, qtype, tmp_path):
    """Phi-3's fused qkv / gate-up and Gemma 2's matrices are whole 2-D blocks: kept exactly, nothing re-rounded;
    the int8 / int4 run computes what transformers' dequantizing loader computes."""
    if kind == "phi3":
        model = hf_model("phi3")
        write_file(model, tmp_path / "model.gguf", "phi3", qtype, meta={"sliding_window": 0})
    else:
        model = hf_model("gemma2", num_attention_heads=2, num_key_value_heads=1, head_dim=256, sliding_window=W,
                         query_pre_attn_scalar=256, tie_word_embeddings=True)
        write_file(model, tmp_path / "model.gguf", "gemma2", qtype,
                   meta={"sliding_window": W, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0})
    report = import_gguf_keep_quant(tmp_path / "model.gguf", tmp_path / "run")
    assert quant_spec(load_config(tmp_path / "run")).type == {"Q8_0": "int8", "Q4_0": "int4"}[qtype]
    assert not any("re-rounded into" in n for n in report.notes), report.notes
    assert_logits_match(tmp_path / "run", transformers_gguf(tmp_path))


def test_keep_quant_of_a_mixture_of_experts_keeps_experts_float_and_rounds_the_router(tmp_path):
    """Stacked experts are no nn.Linear of a quantized run: they are dequantized and stored float; the router,
    F32 in the file, is rounded into int8 (and said so); the attention matrices keep their Q8_0 bits."""
    model = hf_model("mixtral", **MOE)
    held = write_file(model, tmp_path / "model.gguf", "llama", "Q8_0",
                      meta={"expert_count": 4, "expert_used_count": 2})
    report = import_gguf_keep_quant(tmp_path / "model.gguf", tmp_path / "run")
    assert any("re-rounded into" in n and "F32" in n for n in report.notes), report.notes
    stored = dict(iter_tensors(tmp_path / "run"))
    assert stored["blocks.0.ffn.gate_up"].dtype == torch.float32 and "blocks.0.ffn.router.qweight" in stored
    assert stored["blocks.0.attn.qkv.qweight"].dtype == torch.int8
    # the experts hold exactly the file's dequantized values
    ff = model.config.intermediate_size
    torch.testing.assert_close(stored["blocks.0.ffn.gate_up"][:, :ff],
                               held["model.layers.0.mlp.experts.gate_up_proj"][:, :ff], atol=0, rtol=0)
    assert_logits_match(tmp_path / "run", holding(model, held), atol=5e-3)  # the router's int8 rounding


# ------------------------------------------------------------------------------------------------ export

EXPORT_CASES = {
    # transformers' GGUF loader reads everything these files say (Qwen3: its loader assumes Qwen3Config's
    # head_dim 128, so the model has it; Qwen3-MoE: its default expert width 768, as above)
    "qwen3": ("qwen3", dict(head_dim=128), True),
    "phi3": ("phi3", {}, True),
    "qwen3-moe": ("qwen3_moe", {**QWEN3_MOE, "moe_intermediate_size": 768}, True),
    # Gemma with the defaults of transformers' Gemma2Config / Gemma3TextConfig (query_pre_attn_scalar 256, soft-caps
    # 50 / 30, layer patterns), which its loader assumes; llama.cpp's too
    "gemma2": ("gemma2", dict(num_attention_heads=2, num_key_value_heads=1, head_dim=256, sliding_window=W,
                              query_pre_attn_scalar=256, tie_word_embeddings=True), True),
    "gemma3": ("gemma3_text", dict(num_attention_heads=2, num_key_value_heads=1, head_dim=256, sliding_window=W,
                                   query_pre_attn_scalar=256, tie_word_embeddings=True), True),
    # it does not (LongRoPE, Phi-3's window, Mixtral's experts): the re-import is compared with the source model
    "phi3-longrope-window": ("phi3", dict(sliding_window=W, **LONGROPE), False),
    "mixtral": ("mixtral", MOE, False),
}


@pytest.mark.parametrize("case,qtype", [(c, "f32") for c in EXPORT_CASES]
                         + [(c, "q8_0") for c, (_, _, reads) in EXPORT_CASES.items() if reads])
def test_gguf_export_of_qwen3_phi3_gemma_and_mixtures_loads_back(case, qtype, tmp_path):
    """--to-gguf: re-importing an f32 file gives the run's config and tensors exactly; transformers' loader (where it
    reads the architecture) computes the run's logits from the file, f32 or q8_0; the re-import computes what the
    source model computes (f32) or what transformers' loader computes from the same q8_0 bits."""
    from test_interop_common import save_hf

    from tinyformer.interop.gguf_export import export_gguf
    from tinyformer.interop.hf_folder import import_hf

    kind, overrides, transformers_reads_it = EXPORT_CASES[case]
    model = hf_model(kind, **overrides)
    save_hf(model, tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "run")
    out = tmp_path / "out" / "model.gguf"
    out.parent.mkdir()
    export_gguf(tmp_path / "run", out, qtype)
    import_gguf(out, tmp_path / "back")
    length = L0 + 8 if "longrope" in case else 24
    if qtype == "f32":
        ours, back = load_config(tmp_path / "run").to_dict(), load_config(tmp_path / "back").to_dict()
        ours.pop("extra"), back.pop("extra")
        assert back == ours
        tensors = dict(iter_tensors(tmp_path / "back"))
        for name, tensor in iter_tensors(tmp_path / "run"):  # Gemma's gains come back as (g + 1) - 1
            shifted = kind.startswith("gemma") and name.endswith("norm.weight")
            torch.testing.assert_close(tensors[name], tensor, atol=1e-7 if shifted else 0, rtol=0, msg=name)
        assert_logits_match(tmp_path / "back", model, length=length)
    if transformers_reads_it:
        theirs = transformers_gguf(out.parent)
        assert_logits_match(tmp_path / "back", theirs, length=length)
        if qtype == "f32":
            assert_logits_match(tmp_path / "run", theirs, length=length)


def test_gguf_export_refuses_what_llama_cpp_cannot_compute(tmp_path):
    from test_interop_common import save_hf

    from tinyformer.interop.gguf_export import export_gguf
    from tinyformer.interop.hf_folder import import_hf

    save_hf(hf_model("qwen3_moe", **{**QWEN3_MOE, "norm_topk_prob": False}), tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "moe")
    with pytest.raises(ConfigError, match="renormalises"):
        export_gguf(tmp_path / "moe", tmp_path / "moe.gguf")
    save_hf(hf_model("mistral", sliding_window=W), tmp_path / "hf2")
    import_hf(tmp_path / "hf2", tmp_path / "mistral")
    with pytest.raises(ConfigError, match="no sliding-window attention"):
        export_gguf(tmp_path / "mistral", tmp_path / "mistral.gguf")
    save_hf(hf_model("gemma2", head_dim=16, sliding_window=W, tie_word_embeddings=True, query_pre_attn_scalar=24),
            tmp_path / "hf3")
    import_hf(tmp_path / "hf3", tmp_path / "gemma")
    with pytest.raises(ConfigError, match="head_dim"):
        export_gguf(tmp_path / "gemma", tmp_path / "gemma.gguf")
    assert not any(tmp_path.glob("*.gguf"))
