"""Training objectives, registered by name: ``tinyformer train --objective NAME`` picks one.

Each is a subclass of :class:`~tinyformer.training.objectives.base.Objective` (what a batch is, what loss
the trainer minimises) in a module of its own:

    clm       causal language modelling (GPT, LLaMA) on a corpus                        lm.py
    mlm       masked language modelling (BERT)                                          mlm.py
    seq2seq   synthetic sequence-to-sequence tasks for the encoder-decoder              seq2seq.py
    sft       the causal LM loss on the assistant tokens of conversations only         sft.py
    dpo       direct preference optimisation on (prompt, chosen, rejected) pairs       dpo.py
    grpo      group relative policy optimisation on prompts, with program rewards    grpo.py

Adding an objective is one module and its class in :data:`OBJECTIVES`.
"""

from __future__ import annotations

from tinyformer.errors import ConfigError
from tinyformer.training.objectives.base import Batch, Objective
from tinyformer.training.objectives.dpo import DPOObjective
from tinyformer.training.objectives.grpo import GRPOObjective
from tinyformer.training.objectives.lm import CausalLM
from tinyformer.training.objectives.mlm import MaskedLM
from tinyformer.training.objectives.seq2seq import Seq2SeqObjective
from tinyformer.training.objectives.sft import SFTObjective

__all__ = ["OBJECTIVES", "Batch", "Objective", "get_objective"]

#: name -> objective class
OBJECTIVES: dict[str, type[Objective]] = {
    cls.name: cls for cls in (CausalLM, MaskedLM, Seq2SeqObjective, SFTObjective, DPOObjective, GRPOObjective)
}


def get_objective(name: str) -> type[Objective]:
    """The objective class registered as ``name``; a ConfigError lists the known ones otherwise."""
    if name not in OBJECTIVES:
        raise ConfigError(f"unknown objective {name!r}; known objectives: {', '.join(sorted(OBJECTIVES))}")
    return OBJECTIVES[name]
