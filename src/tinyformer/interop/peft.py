"""A LoRA run out: a plain merged run folder, or a Hugging Face PEFT adapter folder.

    tinyformer convert --model LORA_RUN --merge-lora --out MERGED   run folder with W + (alpha/r) B A
    tinyformer convert --model LORA_RUN --to-peft DIR               adapter_config.json + adapter_model.safetensors

The PEFT folder loads with ``peft.PeftModel.from_pretrained(model, DIR)`` onto the ``--to-hf`` export of the
LoRA run's base run. Name mapping, per layer i and target (components/lora.py):

    blocks.i.attn.qkv.lora_{A,B}.{q,k,v}     base_model.model.model.layers.i.self_attn.{q,k,v}_proj.lora_{A,B}.weight
    blocks.i.attn.out.lora_{A,B}.o           base_model.model.model.layers.i.self_attn.o_proj.lora_{A,B}.weight
    blocks.i.ffn.gate_up.lora_{A,B}.gate     base_model.model.model.layers.i.mlp.gate_proj.lora_{A,B}.weight
    blocks.i.ffn.gate_up.lora_{A,B}.up       base_model.model.model.layers.i.mlp.up_proj.lora_{A,B}.weight
    blocks.i.ffn.down.lora_{A,B}.down        base_model.model.model.layers.i.mlp.down_proj.lora_{A,B}.weight

RoPE convention: an adapter's B rows are output rows of W_q / W_k, so they must be permuted exactly as the
base weights are at the export boundary. tinyformer and Hugging Face Llama both pair dimension i with
i + d_head/2 (families/llama/hf.py copies q/k rows unpermuted; a GGUF import permutes them once, on the way in),
so B_q and B_k are copied unpermuted too. PEFT scales by lora_alpha / r, as tinyformer does (no rsLoRA).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from tinyformer.devices import DTYPES
from tinyformer.errors import CheckpointError, ConfigError
from tinyformer.interop.convert_pipeline import ConvertReport, staged_output
from tinyformer.utils.io import atomic_write_text

#: tinyformer (module, target) -> Hugging Face Llama module, under model.layers.i
HF_MODULES = {
    ("attn.qkv", "q"): "self_attn.q_proj", ("attn.qkv", "k"): "self_attn.k_proj",
    ("attn.qkv", "v"): "self_attn.v_proj", ("attn.out", "o"): "self_attn.o_proj",
    ("ffn.gate_up", "gate"): "mlp.gate_proj", ("ffn.gate_up", "up"): "mlp.up_proj",
    ("ffn.down", "down"): "mlp.down_proj",
}
_KEY = re.compile(r"^blocks\.(\d+)\.(attn\.qkv|attn\.out|ffn\.gate_up|ffn\.down)\.lora_([AB])\.(\w+)$")
PEFT_PREFIX = "base_model.model.model.layers."


def _adapter_run(run: str | Path):  # -> (LoRAConfig, base Path, ModelConfig, tensors)
    from tinyformer import run_folder

    run = Path(run)
    if not run_folder.is_adapter_run(run):
        raise CheckpointError(f"{run} is not a LoRA run (it has no {run_folder.ADAPTER_CONFIG}); "
                              "--merge-lora and --to-peft read a run trained with --lora-rank")
    lora, base = run_folder.read_adapter_config(run)
    path = run / run_folder.ADAPTER_WEIGHTS
    if not path.is_file():
        raise CheckpointError(f"LoRA run {run} has no {run_folder.ADAPTER_WEIGHTS} yet")
    return lora, base, run_folder.load_config(run), run_folder.load_safetensors(path)


def peft_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """tinyformer adapter names -> PEFT names (see the module docstring); unknown names are an error."""
    out = {}
    for key, value in tensors.items():
        m = _KEY.match(key)
        if m is None or (m.group(2), m.group(4)) not in HF_MODULES:
            raise CheckpointError(f"adapter tensor {key!r} has no Hugging Face Llama counterpart")
        layer, module, ab, target = m.groups()
        out[f"{PEFT_PREFIX}{layer}.{HF_MODULES[module, target]}.lora_{ab}.weight"] = value.contiguous()
    return out


def export_peft(run: str | Path, out: str | Path, *, dtype: str | None = None, force: bool = False) -> ConvertReport:
    """LoRA run -> PEFT adapter folder for the ``--to-hf`` export of its base run."""
    from tinyformer import run_folder
    from tinyformer.families.llama.hf import layout_problem

    lora, base, cfg, tensors = _adapter_run(run)
    if run_folder.is_adapter_run(base):
        raise ConfigError(f"the base run {base} is itself a LoRA run: merge it (--merge-lora) and train the "
                          "adapter on the merged run to export it for PEFT")
    if problem := layout_problem(cfg):
        raise ConfigError(problem)
    dt = DTYPES[dtype] if dtype else next(iter(tensors.values())).dtype
    named = {k: v.to(dt) for k, v in peft_tensors(tensors).items()}
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base),
        "r": lora.rank, "lora_alpha": lora.scale * lora.rank, "lora_dropout": lora.dropout,
        "target_modules": sorted({HF_MODULES[k].split(".")[1] for k in HF_MODULES if k[1] in lora.targets}),
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
    }
    with staged_output(out, force, (Path(run),)) as staging:
        run_folder.save_safetensors(staging / "adapter_model.safetensors", named)
        atomic_write_text(staging / "adapter_config.json", json.dumps(config, indent=2) + "\n")
        files = sorted(p.name for p in staging.iterdir())
    n = sum(v.numel() for v in named.values())
    notes = [f"load it onto the Hugging Face export of the base run: tinyformer convert --model {base} --to-hf DIR"]
    return ConvertReport(Path(out), cfg, dt, n, files, notes)


def merge_run(run: str | Path, out: str | Path, *, dtype: str | None = None, force: bool = False,
              max_shard_bytes: int | None = None) -> ConvertReport:
    """LoRA run -> a plain run folder holding the base weights with the adapter merged in."""
    from tinyformer import run_folder

    _adapter_run(run)  # a clear error before the base is loaded
    model = run_folder.load_model(run)
    dt = DTYPES[dtype] if dtype else next(model.parameters()).dtype
    kwargs = {"max_shard_bytes": max_shard_bytes} if max_shard_bytes else {}
    with staged_output(out, force, (Path(run),)) as staging:
        run_folder.save_model(staging, model, dtype=dt, **kwargs)
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (Path(run) / name).is_file():
                shutil.copyfile(Path(run) / name, staging / name)
        files = sorted(p.name for p in staging.iterdir())
    return ConvertReport(Path(out), model.cfg, dt, sum(p.numel() for p in model.parameters()), files)
