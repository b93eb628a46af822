"""LoRA: low-rank adapters on a model's linear layers (Hu et al. 2021), trained while the base is frozen.

For a linear layer y = W x + b with W (out, in), each adapted block of rows s of W gets

    y_s = W_s x + b_s + (alpha / r) B_s A_s dropout(x)          A_s (r, in), B_s (out_s, r)

A_s is drawn Kaiming-uniform (``kaiming_uniform_(a=sqrt(5))``, as PEFT does) and B_s starts at zero, so
before the first update the adapted model computes exactly the base model. Only A and B are trained:
apply_lora sets ``requires_grad = False`` on every base parameter, so the optimizer (which takes trainable
tensors only, training/optim.py) never holds a copy or a moment of them. Merging folds the update into the
weight: W_s <- W_s + (alpha / r) B_s A_s, after which the layer is a plain ``nn.Linear`` again.

Targets name the projections of the Llama layout, as PEFT spells them on the Hugging Face side:

    target   tinyformer rows                                   Hugging Face / PEFT module
    q        attn.qkv rows [0, H d_head)                       self_attn.q_proj
    k        attn.qkv rows [H d_head, (H + H_kv) d_head)       self_attn.k_proj
    v        attn.qkv rows [(H + H_kv) d_head, end)            self_attn.v_proj
    o        attn.out (all rows)                               self_attn.o_proj
    gate     ffn.gate_up rows [0, d_ff)       (SwiGLU)         mlp.gate_proj
    up       ffn.gate_up rows [d_ff, 2 d_ff)  (SwiGLU),
             ffn.up (all rows)                (GELU/ReLU MLP)  mlp.up_proj
    down     ffn.down (all rows)                               mlp.down_proj

tinyformer fuses q/k/v into one matrix and gate/up into another (one matmul each); every target still has
its own A_s and B_s, so an adapter here is the same set of matrices as PEFT's separate q_proj/k_proj/...
adapters (interop/peft.py writes them out under those names). When dropout is off, the A_s of one fused
layer are applied as one (n r, in) matrix: one matmul for all its targets.

Shapes: x (..., in) -> y (..., out); the LoRA path goes x -> (..., r) -> (..., out_s) per target.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tinyformer.errors import ConfigError

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
#: how an adapter tensor's name tells it apart from the base weights in a state dict
ADAPTER_KEYS = (".lora_A.", ".lora_B.")


@dataclass(frozen=True)
class LoRAConfig:
    """rank r, alpha (default r: the update enters at scale alpha / r = 1, so the learning rate alone sets
    its size), dropout on the adapters' input, and the projections adapted (see the module docstring)."""

    rank: int
    alpha: float | None = None
    dropout: float = 0.0
    targets: tuple[str, ...] = TARGETS

    def __post_init__(self) -> None:
        targets = parse_targets(self.targets) if isinstance(self.targets, str) else tuple(self.targets)
        object.__setattr__(self, "targets", targets)
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ConfigError(f"LoRA rank (--lora-rank) must be a positive integer, got {self.rank!r}")
        if self.alpha is not None and (not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool)
                                       or not math.isfinite(self.alpha) or self.alpha <= 0):
            raise ConfigError(f"LoRA alpha (--lora-alpha) must be a positive number, got {self.alpha!r}")
        if (not isinstance(self.dropout, (int, float)) or isinstance(self.dropout, bool)
                or not 0 <= self.dropout < 1):
            raise ConfigError(f"LoRA dropout (--lora-dropout) must be in [0, 1), got {self.dropout!r}")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ConfigError(f"LoRA targets (--lora-targets) must be distinct names among {','.join(TARGETS)}, "
                              f"got {','.join(self.targets) or 'none'}")

    @property
    def scale(self) -> float:
        """alpha / r."""
        return float(self.alpha if self.alpha is not None else self.rank) / self.rank

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha if self.alpha is not None else float(self.rank),
                "dropout": self.dropout, "targets": list(self.targets)}


def parse_targets(text: str) -> tuple[str, ...]:
    """``"q,v"`` -> ("q", "v")."""
    return tuple(t.strip() for t in text.split(",") if t.strip())


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` whose row blocks ``segments`` [(target, start, stop), ...] carry LoRA adapters.

    It holds the base layer's own ``weight`` and ``bias`` Parameters (same objects, same state-dict names),
    plus ``lora_A[target]`` (r, in) and ``lora_B[target]`` (stop - start, r). ``enabled = False`` computes
    the base layer alone."""

    def __init__(self, base: nn.Linear, segments: list[tuple[str, int, int]], cfg: LoRAConfig) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.segments = segments
        self.scale = cfg.scale
        self.dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        self.enabled = True
        w = base.weight
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        for name, start, stop in segments:
            a = torch.empty(cfg.rank, self.in_features, device=w.device, dtype=w.dtype)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
            self.lora_A[name] = nn.Parameter(a)
            self.lora_B[name] = nn.Parameter(torch.zeros(stop - start, cfg.rank, device=w.device, dtype=w.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return F.linear(x, self.weight, self.bias)
        r = next(iter(self.lora_A.values())).shape[0]
        if isinstance(self.dropout, nn.Identity) or not self.training:
            a = torch.cat([self.lora_A[n] for n, _, _ in self.segments]) if len(self.segments) > 1 \
                else self.lora_A[self.segments[0][0]]
            u = F.linear(x, a)  # (..., n r): one matmul for all targets (x @ A^T first: r << in, out)
            if self.scale != 1.0:  # scaling the (..., n r) rank space is the cheapest place for it
                u = u * self.scale
        else:  # one dropout mask per target, as PEFT's separate modules draw
            u = torch.cat([F.linear(self.dropout(x), self.lora_A[n]) * self.scale for n, _, _ in self.segments],
                          dim=-1)
        lead = x.shape[:-1]
        # the update of every output row in one GEMM, u @ B^T with B (out, n r) block-diagonal (B_s in
        # target s's rows and columns, zero rows for rows without an adapter); then W x is accumulated
        # into it in place by the big GEMM (beta = 1): no separate add pass and no writes into row blocks,
        # whose backward would clone and zero-fill the full (..., out) gradient
        y = F.linear(u.reshape(-1, u.shape[-1]), self._block_b(r))  # (M, out)
        y.addmm_(x.reshape(-1, self.in_features), self.weight.t())
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def _block_b(self, r: int) -> torch.Tensor:
        """The (out, n r) block-diagonal matrix of the B_s (a few KB: built per call, no weight copied)."""
        if len(self.segments) == 1 and self.segments[0][1:] == (0, self.out_features):
            return self.lora_B[self.segments[0][0]]
        n = len(self.segments)
        rows, pos = [], 0
        first = self.lora_B[self.segments[0][0]]
        for i, (name, start, stop) in enumerate(self.segments):
            if start > pos:
                rows.append(first.new_zeros(start - pos, n * r))
            rows.append(F.pad(self.lora_B[name], (i * r, (n - 1 - i) * r)))
            pos = stop
        if pos < self.out_features:
            rows.append(first.new_zeros(self.out_features - pos, n * r))
        return torch.cat(rows)

    @torch.no_grad()
    def delta(self, name: str) -> torch.Tensor:
        """(alpha / r) B A of target ``name``, computed in float32: (stop - start, in)."""
        return self.scale * (self.lora_B[name].float() @ self.lora_A[name].float())

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora={[n for n, _, _ in self.segments]}, scale={self.scale:g}"


def _layer_segments(module: nn.Module) -> list[tuple[str, list[tuple[str, int, int]]]]:
    """The adaptable linear layers of ``module`` (by attribute) with their target row blocks."""
    from tinyformer.components.attention import SelfAttention
    from tinyformer.components.ffn import MLP, SwiGLU

    if isinstance(module, SelfAttention):
        q, kv = module.q_size, module.kv_size
        return [("qkv", [("q", 0, q), ("k", q, q + kv), ("v", q + kv, q + 2 * kv)]),
                ("out", [("o", 0, module.out.out_features)])]
    if isinstance(module, SwiGLU):
        f = module.d_ff
        return [("gate_up", [("gate", 0, f), ("up", f, 2 * f)]), ("down", [("down", 0, module.down.out_features)])]
    if isinstance(module, MLP):
        return [("up", [("up", 0, module.up.out_features)]), ("down", [("down", 0, module.down.out_features)])]
    return []


def apply_lora(model: nn.Module, cfg: LoRAConfig) -> None:
    """Freeze every parameter of ``model`` and put LoRA adapters on the targeted projections, in place.

    Raises ConfigError when the model already has adapters or when no layer matches ``cfg.targets``."""
    if has_lora(model):
        raise ConfigError("the model already has LoRA adapters; merge them first (merge_lora)")
    model.requires_grad_(False)
    found = 0
    for module in list(model.modules()):
        for attr, segments in _layer_segments(module):
            chosen = [s for s in segments if s[0] in cfg.targets]
            base = getattr(module, attr)
            if chosen and isinstance(base, nn.Linear):
                setattr(module, attr, LoRALinear(base, chosen, cfg))
                found += 1
    if not found:
        raise ConfigError(f"no linear layer of this model matches the LoRA targets {','.join(cfg.targets)}")
    model.lora_config = cfg


def lora_layers(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    return ((n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear))


def has_lora(model: nn.Module) -> bool:
    return any(True for _ in lora_layers(model))


@contextlib.contextmanager
def lora_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Inside, every adapter is switched off: the model computes its base (e.g. DPO's reference model,
    without a second copy of the weights)."""
    layers = [m for _, m in lora_layers(model)]
    before = [m.enabled for m in layers]
    for m in layers:
        m.enabled = False
    try:
        yield model
    finally:
        for m, was in zip(layers, before):
            m.enabled = was


@torch.no_grad()
def merge_lora(model: nn.Module) -> None:
    """W_s <- W_s + (alpha / r) B_s A_s for every adapter, then make each layer a plain ``nn.Linear`` again
    (same weight Parameter) and every parameter trainable: ``model`` is an ordinary model afterwards."""
    for name, layer in list(lora_layers(model)):
        for target, start, stop in layer.segments:
            layer.weight[start:stop] += layer.delta(target).to(layer.weight.dtype)
        plain = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
        plain.weight, plain.bias = layer.weight, layer.bias
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, plain)
    model.requires_grad_(True)
    if hasattr(model, "lora_config"):
        del model.lora_config


def is_adapter_key(name: str) -> bool:
    return any(k in name for k in ADAPTER_KEYS)


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors only, by state-dict name (``blocks.0.attn.qkv.lora_A.q``, ...)."""
    return {k: v for k, v in model.state_dict().items() if is_adapter_key(k)}


def base_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's tensors (the names a plain run folder stores)."""
    return {k: v for k, v in model.state_dict().items() if not is_adapter_key(k)}


def trainable_share(model: nn.Module) -> tuple[int, int]:
    """(trainable parameters, all parameters), each shared tensor counted once."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
