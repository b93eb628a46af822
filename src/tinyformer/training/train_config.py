"""TrainConfig: every choice of a training run as an explicit, validated field, and run-config files.

A run is described by a YAML/TOML/JSON file with two sections::

    model:                 # a preset plus overrides, or every ModelConfig field
      preset: tiny
      d_model: 192
    train:                 # TrainConfig fields
      max_steps: 2000
      lr: 1.0e-3

Every field can be overridden on the command line, as ``--set train.lr=3e-4`` or ``--train.lr 3e-4``
(``model.*`` likewise). The resolved config (the model section fully expanded, no preset) is saved
in the run folder as ``train.yaml``; that file alone reproduces the run.

Batch sizes are per rank and per micro-step; the tokens one optimizer step sees are
``batch_size * grad_accum * world_size * block_size`` (the *global* batch).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinyformer.config import ModelConfig
from tinyformer.config_files import read_structured_file
from tinyformer.errors import ConfigError

#: The model a run gets when its config names none.
DEFAULT_PRESET = "tiny"

LR_SCHEDULES = ("cosine", "linear", "constant")
DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = ("auto", "float32", "bfloat16", "float16")
PARALLEL_MODES = ("ddp", "fsdp")
TOKENIZER_KINDS = ("char", "bpe")
#: how the GRPO loss averages its per-token terms (training/objectives/grpo.py)
GRPO_LOSSES = ("token", "sequence")

#: TrainConfig fields that may differ when a run is resumed: they steer logging, saving and
#: hardware, not the sequence of updates (``max_steps`` extends or shortens the run; with the
#: default ``decay_steps`` it also reshapes the schedule, which is the user's explicit choice).
RESUME_MUTABLE = frozenset({
    "max_steps", "eval_interval", "eval_iters", "log_interval", "sample_tokens", "sample_prompt",
    "checkpoint_interval", "keep_last", "peak_flops", "tensorboard", "progress", "device", "threads",
    "compile", "cache_dir", "parallel",
})


@dataclass
class TrainConfig:
    """How to train: data, tokenizer, objective, batch, optimizer, schedule, hardware, logging, saving.

    The defaults are the run ``tinyformer train`` makes with no arguments: the ``tiny`` preset
    (4.0M parameters) on the built-in corpus with a 4096-token BPE, 400 steps of 16 x 256 tokens,
    sized to finish within 10 minutes on two CPU cores (configs/default.yaml spells it out). The
    learning-rate schedule of lr, min_lr, warmup_steps, lr_schedule and decay_steps is ``optim.lr_at``'s.
    """

    # data
    data: str | None = None  # a file, folder of .txt/.md, glob, .jsonl or hf:NAME; None = built-in corpus
    text_field: str = "text"  # the field of each JSONL record that holds the text
    val_fraction: float = 0.1  # the last fraction of the tokens is the validation split
    cache_dir: str | None = None  # token-file cache; None = $TINYFORMER_CACHE or ~/.cache/tinyformer
    # tokenizer: "char", "bpe" (trained on the corpus) or a path to a tokenizer.json / run folder
    tokenizer: str = "bpe"
    vocab_size: int | None = None  # bpe only; None = 4096
    # start from another run's weights and tokenizer (fine-tuning); None = random initialisation
    init_from: str | None = None
    # LoRA (components/lora.py): train adapters of this rank on the frozen init_from model; None = all weights
    lora_rank: int | None = None
    lora_alpha: float | None = None  # None = lora_rank (update scale alpha / rank = 1)
    lora_dropout: float = 0.0  # dropout on the adapters' input
    lora_targets: str = "q,k,v,o,gate,up,down"  # comma-separated projections to adapt
    # objective
    objective: str = "clm"
    task: str | None = None
    dpo_beta: float = 0.1  # objective dpo: strength of the pull towards the reference (training/objectives/dpo.py)
    # objective grpo (training/objectives/grpo.py): rewards (training/rewards.py), groups, sampling, the loss
    rewards: list[str] = field(default_factory=list)  # --reward SPEC[=WEIGHT], repeatable
    reward_timeout: float = 10.0  # seconds one reward call may take (then it scores 0, counted)
    group_size: int = 8  # completions sampled per prompt
    max_new_tokens: int = 32  # longest completion
    temperature: float = 1.0  # sampling temperature of the completions
    kl_beta: float = 0.04  # weight of the k3 KL estimate towards the reference (0: no reference)
    clip_eps: float = 0.2  # the ratio is clipped to [1 - eps, 1 + eps]
    std_scale: bool = True  # advantages divided by the group's std (False: --no-std-scale, r - mean only)
    ppo_epochs: int = 1  # optimizer steps on each sampled batch
    grpo_loss: str = "token"  # mean over all completion tokens (TRL's default "dapo"); "sequence": per sequence
    eval_data: str | None = None  # held-out prompts; None = val_fraction of --data
    # batch
    max_steps: int = 400
    batch_size: int = 16  # sequences per micro-step, per rank
    grad_accum: int = 1  # micro-steps per optimizer step
    block_size: int | None = None  # tokens per sequence; None = the model's max_seq_len
    # optimizer (AdamW) and schedule
    lr: float = 2e-3
    min_lr: float | None = None  # floor of the decay; None = lr / 10
    warmup_steps: int = 40
    lr_schedule: str = "cosine"
    decay_steps: int | None = None  # None = max_steps
    weight_decay: float = 0.1
    decay_embeddings: bool = True  # nanoGPT decays every matrix, embeddings included
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    # hardware
    device: str = "auto"
    dtype: str = "auto"  # auto: bfloat16 (or float16 + GradScaler) autocast on GPU, float32 on CPU
    compile: bool = False
    threads: int | None = None  # CPU threads; None = the idle cores by the load average (utils/threads.py)
    # several processes (torchrun / --nproc): ddp replicates the weights, fsdp shards them (training/distributed.py)
    parallel: str = "ddp"
    seed: int = 1337
    # evaluation and logging
    eval_interval: int = 100
    eval_iters: int = 10  # validation batches per evaluation; 0 = the whole split
    log_interval: int = 10
    sample_tokens: int = 200  # length of the sample written at each evaluation; 0 = none
    sample_prompt: str = "\n"
    peak_flops: float | None = None  # FLOP/s of the hardware, for MFU; None = known GPUs only
    tensorboard: bool = True  # also write TensorBoard events when tensorboard is installed
    progress: bool = True  # tqdm progress bar
    # checkpoints
    checkpoint_interval: int | None = None  # None = eval_interval
    keep_last: int = 2

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ConfigError naming the first invalid field (as ``train.<field>``)."""
        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        def check(*rules: tuple[tuple[str, ...], str, Any]) -> None:
            """Each rule is (fields, what each must be, whether a value is that), checked in order."""
            for names, why, ok in rules:
                for name in names:
                    if not ok(getattr(self, name)):
                        raise ConfigError(f"train.{name} {why}, got {getattr(self, name)!r}")

        check((("max_steps", "batch_size", "grad_accum", "log_interval", "eval_interval", "keep_last"),
               "must be a positive integer", lambda v: is_int(v) and v >= 1),
              (("warmup_steps", "eval_iters", "sample_tokens", "seed"), "must be a non-negative integer",
               lambda v: is_int(v) and v >= 0),
              (("block_size", "vocab_size", "decay_steps", "checkpoint_interval", "threads"),
               "must be a positive integer or null", lambda v: v is None or is_int(v) and v >= 1),
              (("lr", "eps"), "must be a positive number", lambda v: is_num(v) and v > 0),
              (("min_lr",), f"must be a number in [0, lr={self.lr}] or null",
               lambda v: v is None or is_num(v) and 0 <= v <= self.lr),
              (("weight_decay",), "must be a non-negative number", lambda v: is_num(v) and v >= 0),
              (("beta1", "beta2"), "must be in [0, 1)", lambda v: is_num(v) and 0 <= v < 1),
              (("dpo_beta",), "must be a positive number", lambda v: is_num(v) and v > 0),
              (("group_size", "max_new_tokens", "ppo_epochs"), "must be a positive integer",
               lambda v: is_int(v) and v >= 1))
        if self.group_size == 1:
            raise ConfigError("train.group_size must be at least 2: GRPO compares the completions of a prompt with "
                              "each other, and a group of 1 has nothing to compare (--group-size 1 refused)")
        check((("temperature", "clip_eps", "reward_timeout"), "must be a positive number",
               lambda v: is_num(v) and v > 0),
              (("kl_beta",), "must be a non-negative number (0: no reference)", lambda v: is_num(v) and v >= 0))
        if self.grpo_loss not in GRPO_LOSSES:
            raise ConfigError(f"train.grpo_loss={self.grpo_loss!r} is not one of {', '.join(GRPO_LOSSES)}")
        check((("rewards",), "must be a list of reward specs (strings)",
               lambda v: isinstance(v, list) and all(isinstance(r, str) for r in v)),
              (("grad_clip",), "must be a non-negative number (0 disables clipping)", lambda v: is_num(v) and v >= 0),
              (("val_fraction",), "must be in [0, 1)", lambda v: is_num(v) and 0 <= v < 1),
              (("peak_flops",), "must be a positive number of FLOP/s or null",
               lambda v: v is None or is_num(v) and v > 0))
        choices = {"lr_schedule": LR_SCHEDULES, "device": DEVICES, "dtype": DTYPES, "parallel": PARALLEL_MODES}
        for name, allowed in choices.items():
            value = getattr(self, name)
            if value not in allowed and not (name == "device" and isinstance(value, str) and ":" in value):
                raise ConfigError(f"train.{name}={value!r} is not one of {', '.join(allowed)}")
        check((("decay_embeddings", "compile", "tensorboard", "progress", "std_scale"), "must be true or false",
               lambda v: isinstance(v, bool)),
              (("text_field", "tokenizer", "objective", "sample_prompt"), "must be a string",
               lambda v: isinstance(v, str)),
              (("data", "cache_dir", "task", "init_from", "eval_data"), "must be a string or null",
               lambda v: v is None or isinstance(v, str)))
        if self.lora_rank is not None or self.lora_alpha is not None or self.lora_dropout != 0.0:
            if self.lora_rank is None:
                raise ConfigError("train.lora_alpha and train.lora_dropout apply with train.lora_rank (--lora-rank R)")
            check((("lora_rank",), "must be a positive integer or null", lambda v: is_int(v) and v >= 1))
        check((("lora_targets",), "must be a comma-separated string such as 'q,v'", lambda v: isinstance(v, str)))
        self.lora_config()
        check((("tokenizer",), "must be 'char', 'bpe' or a path to a tokenizer.json", bool))
        if self.vocab_size is not None and self.tokenizer == "char":
            raise ConfigError(
                "train.vocab_size applies to the bpe tokenizer only; a char vocabulary is the corpus' characters"
            )

    # ------------------------------------------------------------------ derived values
    def lora_config(self):  # -> tinyformer.components.lora.LoRAConfig | None
        """The LoRA settings (validated), or None for a run that trains every weight."""
        from tinyformer.components.lora import LoRAConfig

        if self.lora_rank is None:
            return None
        return LoRAConfig(self.lora_rank, self.lora_alpha, self.lora_dropout, self.lora_targets)

    @property
    def total_decay_steps(self) -> int:
        return self.decay_steps if self.decay_steps is not None else self.max_steps

    @property
    def lr_floor(self) -> float:
        return self.min_lr if self.min_lr is not None else self.lr / 10

    @property
    def save_every(self) -> int:
        return self.checkpoint_interval if self.checkpoint_interval is not None else self.eval_interval

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown train field(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        return cls(**{k: coerce_field(cls, k, v) for k, v in data.items()})

    def replace(self, **changes: Any) -> TrainConfig:
        return TrainConfig.from_dict({**self.to_dict(), **changes})


# ---------------------------------------------------------------------------- values from text


def parse_value(text: str) -> Any:
    """A command-line value as YAML (true, null, [1, 2], 3.5), with YAML 1.1's gaps filled: ``3e-4`` is a float."""
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str):
        for cast in (int, float):
            try:
                return cast(value)
            except ValueError:
                pass
    return value


def coerce_field(cls: type, name: str, value: Any, raw: str | None = None) -> Any:
    """``value`` converted to what field ``name`` of ``cls`` holds when the conversion loses nothing
    (1 -> 1.0 for a float, 1000.0 -> 1000 for an int, the raw text for a string); else unchanged."""
    hint = typing.get_type_hints(cls).get(name)  # from the (string) annotations
    if hint is None:
        return value
    union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    allowed = {typing.get_origin(a) or a for a in (typing.get_args(hint) if union else (hint,))}  # the plain types
    if value is None or type(value) in allowed:
        return value
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if int in allowed and isinstance(value, float) and value.is_integer():
        return int(value)
    if str in allowed and raw is not None:
        return raw
    if str in allowed and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return value


# ---------------------------------------------------------------------------- run files and overrides

SECTIONS = ("model", "train")


def read_run_file(path: str | Path) -> dict[str, dict[str, Any]]:
    """The ``model`` and ``train`` sections of a YAML/TOML/JSON run config (missing ones are empty)."""
    data = read_structured_file(path)
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"{path}: unknown section(s) {', '.join(unknown)}; a run config has model: and train:")
    out: dict[str, dict[str, Any]] = {}
    for section in SECTIONS:
        value = data.get(section) or {}
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: section {section!r} must be a mapping of fields")
        out[section] = dict(value)
    return out


def apply_override(sections: dict[str, dict[str, Any]], item: str) -> None:
    """Apply one ``section.field=value`` override in place (``"train.lr=3e-4"``: train's lr = 0.0003), checking
    that the field exists; the section is required."""
    key, sep, raw = item.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot or section not in SECTIONS or not name:
        raise ConfigError(f"override {item!r} must look like model.FIELD=VALUE or train.FIELD=VALUE")
    value = parse_value(raw)
    cls = ModelConfig if section == "model" else TrainConfig
    known = {f.name for f in dataclasses.fields(cls)} | ({"preset"} if section == "model" else set())
    if name not in known:
        raise ConfigError(f"{section}.{name} is not a field; known {section} fields: {', '.join(sorted(known))}")
    sections.setdefault(section, {})[name] = raw if name == "preset" else coerce_field(cls, name, value, raw)


def build_model_config(section: dict[str, Any]) -> ModelConfig:
    """A ModelConfig from a model section: ``preset`` plus overrides, or all fields; empty = the default preset."""
    from tinyformer.presets import get_preset

    fields = dict(section)
    fields.pop("format_version", None)
    preset = fields.pop("preset", None)
    if preset is None and not fields:
        preset = DEFAULT_PRESET
    fields = {k: coerce_field(ModelConfig, k, v) for k, v in fields.items()}
    if preset is not None:
        return get_preset(str(preset), **fields)
    return ModelConfig.from_dict(fields)


def to_yaml(model_cfg: ModelConfig, train_cfg: TrainConfig) -> str:
    """The resolved run config as YAML (what ``train.yaml`` holds)."""
    import yaml

    model = model_cfg.to_dict()
    model.pop("format_version", None)
    header = "# tinyformer run config (resolved): `tinyformer train --config train.yaml` reproduces this run\n"
    return header + yaml.safe_dump({"model": model, "train": train_cfg.to_dict()}, sort_keys=False,
                                   allow_unicode=True)


def config_differences(a: dict[str, Any], b: dict[str, Any], ignore: frozenset[str] = frozenset()) -> list[str]:
    """Names of the fields whose values differ between two config dicts."""
    return sorted(k for k in set(a) | set(b) if k not in ignore and a.get(k) != b.get(k))
