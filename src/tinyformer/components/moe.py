"""Mixture-of-experts feed-forward layer (Shazeer et al. 2017; Switch, Fedus et al. 2021; Mixtral; Qwen3-MoE).

E experts, each a SwiGLU FFN of width f; a router W_r (E, d) picks k of them per token:

    r = W_r x                                        router logits, (E,)
    softmax_topk:  p = softmax(r);  (g, S) = topk(p, k);  g <- g / sum(g) if router_norm_topk
    topk_softmax:  (r_S, S) = topk(r, k);  g = softmax(r_S)
    MoE(x) = sum_{i in S} g_i Expert_i(x)  (+ Shared(x), an always-on SwiGLU expert, if shared_expert_d_ff > 0)

(topk_softmax equals softmax_topk with normalisation; both are written as the models define them.)
Only k of the E experts run per token: the parameters grow with E, the compute per token with k.

Dispatch, without a Python loop over tokens: the N k (token, expert) assignments are sorted by expert (one
argsort), the tokens gathered once in that order (``index_select``), each expert's contiguous segment multiplied by
its matrices, and the weighted outputs summed back per token with ``index_add_``. The segments are multiplied by
one ``F.grouped_mm`` per projection where it takes the operands (float32 / bfloat16 on CPU, rows a multiple of 16
bytes: empty experts cost nothing, and the weight gradients come out stacked), otherwise by a loop over the experts
that have tokens, reading each expert's matrices in place. A few tokens (N k <= E, decoding) skip the sort: each
token runs its k chosen experts directly. Under ``torch.compile`` at inference (the compiled decode step, which
cannot read the chosen experts back to the host), each token instead gathers its k experts' weights and multiplies
them directly (batched matmuls).

Auxiliary losses (training only; ``moe_losses``), over the router outputs of every MoE layer pooled
(N rows in all), as transformers' ``load_balancing_loss_func``:

    balance (Switch eq. 4-6): L_bal = E * sum_e f_e P_e,   f_e = (1/N) #{rows with e among their top k},
                              P_e = (1/N) sum_rows softmax(r)_e          (= k when perfectly balanced)
    router z-loss (ST-MoE, Zoph et al. 2022): L_z = (1/N) sum_rows (log sum_e exp r_e)^2

Shapes: x (B, T, d) -> (B, T, d). Parameters: router (E, d); gate_up (E, 2f, d), rows [0, f) W_gate and
[f, 2f) W_up of each expert; down (E, d, f).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tinyformer.components.ffn import SwiGLU
from tinyformer.config import ModelConfig


def route(logits: torch.Tensor, k: int, order: str, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights g (N, k), expert indices S (N, k)) from router logits (N, E), per ``order`` (see the module
    docstring). Computed in float32 at least, as the weights of a sum."""
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if order == "topk_softmax":
        top, index = logits.topk(k, dim=-1)
        return torch.softmax(top, dim=-1), index
    top, index = torch.softmax(logits, dim=-1).topk(k, dim=-1)
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top, index


def balance_loss(router_logits: torch.Tensor, k: int) -> torch.Tensor:
    """Switch/Mixtral load-balancing loss E * sum_e f_e P_e over router logits (N, E) (rows of all layers)."""
    n, n_experts = router_logits.shape
    probs = torch.softmax(router_logits.float(), dim=-1)
    chosen = probs.topk(k, dim=-1).indices
    f = torch.zeros(n_experts, device=probs.device).index_add_(
        0, chosen.reshape(-1), torch.ones(chosen.numel(), device=probs.device)) / n
    return n_experts * (f * probs.mean(dim=0)).sum()


def z_loss(router_logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean over rows of (logsumexp_e r_e)^2."""
    return torch.logsumexp(router_logits.float(), dim=-1).pow(2).mean()


class MoE(nn.Module):
    """Top-k routed SwiGLU experts (and an optional shared expert); see the module docstring."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_experts, self.k, self.d_ff = cfg.n_experts, cfg.experts_per_token, cfg.d_ff
        self.order, self.normalize = cfg.router_order, cfg.router_norm_topk
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.gate_up = nn.Parameter(torch.empty(cfg.n_experts, 2 * cfg.d_ff, cfg.d_model))
        self.down = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_model, cfg.d_ff))
        self.shared = SwiGLU(cfg.d_model, cfg.shared_expert_d_ff) if cfg.shared_expert_d_ff else None
        self.router_logits: torch.Tensor | None = None  # the last forward's (N, E), kept while training

    def init_experts(self, std: float, residual_std: float) -> None:
        """N(0, std) for the expert input matrices, N(0, residual_std) for their output (residual) matrices."""
        nn.init.normal_(self.gate_up, mean=0.0, std=std)
        nn.init.normal_(self.down, mean=0.0, std=residual_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, d)
        logits = self.router(flat)  # (N, E)
        self.router_logits = logits if self.training else None
        weights, index = route(logits, self.k, self.order, self.normalize)
        weights = weights.to(x.dtype)
        # the sorted dispatch reads the per-expert counts back to the host, which a compiled (inference) step
        # cannot capture: there each token gathers its k experts' weights instead (a few tokens per step)
        if torch.compiler.is_compiling() and not self.training:
            out = self._gathered(flat, weights, index)
        else:
            out = self._sorted(flat, weights, index)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.reshape(shape)

    def _expert_ffn(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = h.split(self.d_ff, dim=-1)
        return F.silu(gate) * up

    def _gathered(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Each token multiplies by its own k experts' matrices: (N, k, 2f, d) and (N, k, d, f) gathers."""
        h = torch.einsum("nd,nkfd->nkf", x, self.gate_up[index])
        y = torch.einsum("nkf,nkdf->nkd", self._expert_ffn(h), self.down[index])
        return (y * weights[..., None]).sum(dim=1)

    def _sorted(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Assignments sorted by expert; each expert's contiguous slice of tokens multiplied by its matrices."""
        n, k = index.shape
        if n * k <= self.n_experts:
            gate_ups, downs = self._per_expert()
            # a few tokens (decoding): run each token's k chosen experts directly; sorting, counting and
            # scattering back cost more than the k matmul pairs of one token
            rows = []
            for t, chosen in enumerate(index.tolist()):
                ys = torch.stack([F.linear(self._expert_ffn(F.linear(x[t], gate_ups[e])), downs[e]) for e in chosen])
                rows.append(weights[t] @ ys)  # (k,) @ (k, d)
            return torch.stack(rows)
        flat_expert = index.reshape(-1)  # (N k,): assignment a = token a // k, its choice a % k
        order = flat_expert.argsort(stable=True)
        tokens = order // k
        counts = torch.bincount(flat_expert, minlength=self.n_experts)
        xs = x.index_select(0, tokens)  # (N k, d), grouped by expert
        ws = weights.reshape(-1)[order, None]
        if self._grouped_mm_applies(x):
            # one grouped matmul per projection over the E contiguous segments (empty ones cost nothing), with
            # no per-expert kernels and no stacking of per-expert weight gradients in the backward pass
            offsets = counts.cumsum(0, dtype=torch.int32)
            h = F.grouped_mm(xs, self.gate_up.transpose(1, 2), offs=offsets)
            y = F.grouped_mm(self._expert_ffn(h), self.down.transpose(1, 2), offs=offsets) * ws
        else:
            gate_ups, downs = self._per_expert()
            outs = []
            start = 0
            for e, count in enumerate(counts.tolist()):
                if count:
                    seg = xs[start : start + count]
                    outs.append(F.linear(self._expert_ffn(F.linear(seg, gate_ups[e])), downs[e])
                                * ws[start : start + count])
                start += count
            y = torch.cat(outs)  # (N k, d), in expert order
        return torch.zeros_like(x).index_add_(0, tokens, y)

    def _per_expert(self) -> tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]:
        """The experts' matrices for products one expert at a time. Unbound once when gradients flow: the
        unbind's backward stacks the E gradients in one tensor, where indexing the parameter per expert would
        allocate (and add) a full-size zero gradient for every expert. (The grouped matmul needs neither.)"""
        if torch.is_grad_enabled() and self.gate_up.requires_grad:
            return self.gate_up.unbind(0), self.down.unbind(0)
        return self.gate_up, self.down

    def _grouped_mm_applies(self, x: torch.Tensor) -> bool:
        """Whether ``F.grouped_mm`` takes these operands: on CPU it multiplies float32 and bfloat16 (not float64),
        with rows of d, 2f and f elements each a multiple of 16 bytes."""
        return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
                and all(size * x.element_size() % 16 == 0 for size in (x.shape[-1], self.d_ff)))
