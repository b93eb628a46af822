"""Causal language modelling (GPT, LLaMA): predict token t+1 from tokens <= t,

    loss = -1/N sum_{b,t} log p(x_{b,t+1} | x_{b,<=t})
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from tinyformer.config import ModelConfig
from tinyformer.errors import ConfigError
from tinyformer.training.objectives.base import Batch, Objective, plain_module


class CausalLM(Objective):
    """Next-token prediction on random windows of the corpus.

    A batch is ``input_ids`` x (B, T) and ``targets`` y (B, T) with y[b, t] = x[b, t + 1], drawn as
    ``B`` windows of ``T + 1`` tokens at uniform random offsets (``TokenDataset.get_batch``).
    """

    name = "clm"
    scores_builtin_task = True
    no_task_reason = "(language modelling on a corpus); choose an objective that has tasks"

    def model_config(self, model_cfg: ModelConfig) -> ModelConfig:
        if model_cfg.arch != "decoder":
            raise ConfigError(f"objective 'clm' trains a decoder, but model.arch is {model_cfg.arch!r}")
        return model_cfg

    def get_batch(self, split: str, generator: torch.Generator, rank: int = 0, world_size: int = 1) -> Batch:
        x, y = self.dataset.get_batch(split, self.cfg.batch_size, self._block(), generator, rank, world_size)
        return {"input_ids": x, "targets": y}

    def eval_batches(self, split: str, max_batches: int | None, rank: int = 0, world_size: int = 1
                     ) -> Iterator[Batch]:
        for x, y in self.dataset.iter_eval_batches(split, self.cfg.batch_size, self._block(), rank, world_size,
                                                   max_batches):
            yield {"input_ids": x, "targets": y}

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return lm_loss(model, batch["input_ids"], batch["targets"])

    def sample(self, model: nn.Module, device: torch.device) -> str | None:
        if self.cfg.sample_tokens <= 0:
            return None
        from tinyformer.training.sample import sample_text

        return sample_text(model, self.tokenizer, self.cfg.sample_prompt, self.cfg.sample_tokens, device,
                           seed=self.cfg.seed)


def lm_loss(model: nn.Module, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of a decoder's next-token predictions over the targets that are not -100."""
    from tinyformer.models.decoder import DecoderLM

    if isinstance(model, DecoderLM):  # the plain module: its fused head + cross-entropy never stores logits
        return model.loss(input_ids, targets)
    logits = model(input_ids)  # a wrapper (compiled, DDP) must be called through forward
    loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    inner = plain_module(model)  # under torchrun with compile: compiled(DDP(model))
    if isinstance(inner, DecoderLM) and inner.training and inner.cfg.ffn == "moe":
        loss = loss + inner.router_loss()  # the MoE balancing / z-losses, as DecoderLM.loss adds them
    return loss
