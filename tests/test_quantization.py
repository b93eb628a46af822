"""int8 / int4 weight-only quantization: the formulas, the layers, the run folder and a trained model.

References: the round-trip bound is the rounding's (half a quantization step per group), the layers are
compared with F.linear on the dequantized weight in float64, and the quantized run's logits with a float
model holding the dequantized weights. The speed and quality claims are checked on a model trained here.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import TRAINED_CORPUS as CORPUS

from tinyformer.cli.main import main
from tinyformer.components.quantized import (
    QuantizedLinear,
    QuantSpec,
    dequantize_weight,
    fbgemm_reduce_range,
    pack_int4,
    quantize_weight,
    unpack_int4,
)
from tinyformer.config import ModelConfig
from tinyformer.data.tokenizer import build_tokenizer
from tinyformer.errors import ConfigError
from tinyformer.generation.generator import Generator
from tinyformer.generation.sampling import SamplingParams
from tinyformer.models import build_model
from tinyformer.models.decoder import DecoderLM
from tinyformer.quantization import quantize_run
from tinyformer.run_folder import iter_tensors, load_model, load_tokenizer, save_model

pytestmark = pytest.mark.usefixtures("one_thread")

LAYOUTS = [QuantSpec("int8", 0), QuantSpec("int8", 32), QuantSpec("int4", 32), QuantSpec("int4", 64)]


def weight_with_outliers(out_f: int = 48, in_f: int = 128) -> torch.Tensor:
    w = torch.randn(out_f, in_f)
    w[0, 3] = 9.0  # one large value per some groups: the step there is large, elsewhere small
    w[5, :32] = 0.25  # a constant group: stored exactly
    return w


def steps(parts: dict[str, torch.Tensor], spec: QuantSpec, in_f: int) -> torch.Tensor:
    """The quantization step s of each weight's group, broadcast to (out, in)."""
    return parts["scales"].repeat_interleave(spec.groups(in_f), dim=1)


@pytest.mark.parametrize("spec", LAYOUTS, ids=str)
def test_round_trip_error_is_within_half_a_step_for_every_layout(spec):
    w = weight_with_outliers()
    parts = quantize_weight(w, spec)
    err = (dequantize_weight(parts, spec.type) - w).abs()
    assert torch.all(err <= steps(parts, spec, w.shape[1]) / 2 + 1e-6 * w.abs().max())
    if spec.group_size == 32:  # a group of equal values is stored exactly
        torch.testing.assert_close(dequantize_weight(parts, spec.type)[5, :32], w[5, :32], rtol=1e-6, atol=0)
    q = parts["qweight"] if spec.type == "int8" else unpack_int4(parts["qweight"])
    lo, hi = (-127, 127) if spec.type == "int8" else (0, 15)
    assert int(q.min()) >= lo and int(q.max()) <= hi


def test_int4_packing_is_two_values_per_byte_low_nibble_first():
    u = torch.randint(0, 16, (4, 10))
    packed = pack_int4(u)
    assert packed.shape == (4, 5) and packed.dtype == torch.uint8
    assert torch.equal(packed[:, 0], (u[:, 0] + 16 * u[:, 1]).to(torch.uint8))
    assert torch.equal(unpack_int4(packed), u.to(torch.uint8))


@pytest.mark.parametrize("spec", [QuantSpec("int8", 0, "aten"), QuantSpec("int8", 0, "dequant"),
                                  QuantSpec("int8", 32, "dequant"), QuantSpec("int4", 32, "aten"),
                                  QuantSpec("int4", 64, "dequant")], ids=str)
def test_quantized_linear_equals_x_times_dequantized_weight(spec):
    w, b, x = weight_with_outliers(), torch.randn(48), torch.randn(2, 5, 128)
    parts = quantize_weight(w, spec)
    layer = QuantizedLinear(parts, spec, 128, b)
    assert layer.kernel == spec.kernel
    expected = F.linear(x.double(), dequantize_weight(parts, spec.type, torch.float64), b.double())
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(layer.weight.double(), dequantize_weight(parts, spec.type, torch.float64),
                               rtol=1e-5, atol=1e-5)


def test_fbgemm_kernel_differs_from_weight_only_by_the_activation_rounding_at_most():
    """fbgemm rounds x to 8 bits (x ~ s_x (q - z), s_x = (max x - min x) / 255 over the call; 7 bits, / 127, on a
    CPU without VNNI, where 8 would saturate its products): each output moves by at most sum_k |W_nk| s_x / 2
    from x dequant(W)^T."""
    spec = QuantSpec("int8", 0, "fbgemm")
    w, x = weight_with_outliers(), torch.randn(3, 128)
    parts = quantize_weight(w, spec)
    wd = dequantize_weight(parts, "int8", torch.float64)
    y = QuantizedLinear(parts, spec, 128)(x).double()
    levels = 127 if fbgemm_reduce_range() else 255
    s_x = (float(x.max()) - min(float(x.min()), 0.0)) / levels
    bound = wd.abs().sum(1) * s_x / 2 + 1e-4
    assert torch.all((y - x.double() @ wd.t()).abs() <= bound)


def test_spec_validation_names_the_problem():
    with pytest.raises(ConfigError, match="int4 needs an even group_size"):
        QuantSpec("int4", 0)
    with pytest.raises(ConfigError, match="not one of int8, int4"):
        QuantSpec("int3")
    with pytest.raises(ConfigError, match="fbgemm"):
        QuantSpec("int8", 32, "fbgemm")
    with pytest.raises(ConfigError, match="does not divide"):
        QuantSpec("int8", 48).groups(128)


# ------------------------------------------------------------------ run folders and the command line



def tiny_run(folder, tie: bool = True):
    tok = build_tokenizer("char", CORPUS)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=64, n_layer=2, n_head=4, n_kv_head=2, d_ff=128,
                      max_seq_len=64, tie_embeddings=tie, attn_bias=True)
    model = DecoderLM(cfg)
    save_model(folder, model)
    tok.save(folder / "tokenizer.json")
    return folder


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("spec", [QuantSpec("int8", 0, "dequant"), QuantSpec("int4", 32, "aten")], ids=str)
def test_quantized_run_computes_the_float_model_with_dequantized_weights(spec, tie, tmp_path):
    run = tiny_run(tmp_path / "run", tie)
    quantize_run(run, tmp_path / "q", spec)
    stored = dict(iter_tensors(tmp_path / "q"))
    assert "lm_head.qweight" in stored and "tok_emb.weight" not in stored if tie else "tok_emb.weight" in stored
    reference = load_model(run)
    with torch.no_grad():
        for name, module in reference.named_modules():
            if isinstance(module, torch.nn.Linear) and f"{name}.qweight" in stored:
                parts = {p: stored[f"{name}.{p}"] for p in ("qweight", "scales", "zeros") if f"{name}.{p}" in stored}
                module.weight.copy_(dequantize_weight(parts, spec.type))  # tied: the table follows the head
    ids = torch.randint(0, reference.cfg.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(load_model(tmp_path / "q")(ids), reference(ids), rtol=1e-4, atol=1e-4)


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_quantize_cli_reports_bytes_and_refuses_bad_input_without_writing(tmp_path, capsys):
    run = tiny_run(tmp_path / "run")
    code, out, err = cli(capsys, "quantize", "--model", str(run), "--out", str(tmp_path / "q8"), "--type", "int8",
                         "--report", "--json")
    assert code == 0, err
    report = json.loads(out)
    stored = sum(t.numel() * t.element_size() for _, t in iter_tensors(tmp_path / "q8"))
    assert report["quantized_bytes"] == stored < report["float_bytes"] / 3
    assert {layer["name"] for layer in report["layers"]} >= {"lm_head", "blocks.0.attn.qkv"}
    counted = json.loads(cli(capsys, "count", "--config", str(tmp_path / "q8"), "--json")[1])
    assert counted["stored_weights_bytes"] == stored and counted["quantization"]["type"] == "int8"
    assert (tmp_path / "q8" / "tokenizer.json").is_file()
    for args, message in [(["--model", str(tmp_path / "q8"), "--type", "int4"], "already quantized"),
                          (["--model", str(run), "--type", "int4", "--group-size", "24"], "does not divide"),
                          (["--model", str(run), "--type", "int4", "--group-size", "0"], "even group_size")]:
        code, _, err = cli(capsys, "quantize", *args, "--out", str(tmp_path / "bad"))
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1
        assert not (tmp_path / "bad").exists()
    code, _, err = cli(capsys, "convert", "--model", str(tmp_path / "q8"), "--to-hf", str(tmp_path / "bad"))
    assert code == 2 and "quantized run" in err and not (tmp_path / "bad").exists()
    code, out, err = cli(capsys, "generate", "--model", str(tmp_path / "q8"), "--prompt", "the", "--max-new-tokens",
                         "7", "--temperature", "0", "--json", "--ignore-eos", "--verbose")
    assert code == 0, err
    line = json.loads(out)
    assert len(line["token_ids"]) == 7 and line["timings"]["completion_tokens"] == 7
    assert line["timings"]["prompt_tokens"] == 3 and line["timings"]["prefill_ms"] > 0
    assert "tokens/s" in err


# ------------------------------------------------------------------ a trained model


HELD_OUT = "the dog sat on the mat and the cat ran to the sea shore. she sells the shells by the park. "


def perplexity(model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(ids[None, :-1])[0]
    return math.exp(float(F.cross_entropy(logits.float(), ids[1:])))


@pytest.mark.parametrize("spec,ppl_tolerance", [(QuantSpec("int8"), 0.01), (QuantSpec("int4", 32), 0.05)], ids=str)
def test_trained_model_keeps_its_perplexity_and_greedy_text(spec, ppl_tolerance, trained_char_run, tmp_path):
    run, train_loss = trained_char_run
    assert train_loss < 1.0  # it did learn the corpus (a uniform guess is ln 30 = 3.4)
    quantize_run(run, tmp_path / "q", spec)
    fp32, quant = load_model(run), load_model(tmp_path / "q")
    ids = torch.tensor(load_tokenizer(run).encode(HELD_OUT))
    ppl, ppl_q = perplexity(fp32, ids), perplexity(quant, ids)
    assert abs(ppl_q - ppl) / ppl <= ppl_tolerance, (ppl, ppl_q)
    if spec.type == "int8":
        # fp32's greedy continuation, then each model's greedy choice at every one of its 200 positions
        # (teacher-forced: one early near-tie would otherwise make every later position differ)
        params = SamplingParams(temperature=0.0, max_new_tokens=200)
        prompt = ids[:20].tolist()
        text = Generator(fp32, None).generate([prompt], params)[0].token_ids
        assert len(text) == 200
        seq = torch.tensor([prompt + text[:-1]])
        with torch.no_grad():
            ours, theirs = fp32(seq)[0, 19:].argmax(-1), quant(seq)[0, 19:].argmax(-1)
        assert torch.equal(ours, torch.tensor(text))  # the cached decode and the full forward agree
        agree = float((ours == theirs).float().mean())
        assert agree >= 0.95, agree


def test_eval_inspect_and_embed_load_quantized_runs(tmp_path, capsys):
    """The commands that load a run go through run_folder.load_model, which builds the quantized layers."""
    run = tiny_run(tmp_path / "run")
    quantize_run(run, tmp_path / "q4", QuantSpec("int4", 32))
    (tmp_path / "text.txt").write_text(CORPUS * 4)
    assert main(["eval", "--model", str(tmp_path / "q4"), "--data", str(tmp_path / "text.txt"), "--json"]) == 0
    assert main(["inspect", "--model", str(tmp_path / "q4"), "--prompt", "the fox",
                 "--out", str(tmp_path / "ins")]) == 0
    enc = ModelConfig(arch="encoder", vocab_size=40, d_model=32, n_layer=1, n_head=2, pos="learned", norm="layernorm",
                      ffn="gelu", pooler=True, mlm_head=True)
    save_model(tmp_path / "enc", build_model(enc))
    build_tokenizer("char", CORPUS).save(tmp_path / "enc" / "tokenizer.json")
    quantize_run(tmp_path / "enc", tmp_path / "encq", QuantSpec("int8"))
    assert main(["embed", "--model", str(tmp_path / "encq"), "--text", "the fox"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["dim"] == 32
