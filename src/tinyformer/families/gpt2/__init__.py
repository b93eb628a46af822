"""The gpt2 family: GPT-2 (``GPT2LMHeadModel`` / ``GPT2Model``).

    hf.py       HF config.json <-> ModelConfig, and the Conv1D (transposed) tensor names
    presets.py  gpt2-124m, gpt2-350m

Learned positions: no RoPE, so no rotation convention. No GGUF mapping.
"""

from tinyformer.families.family import Family
from tinyformer.families.gpt2 import hf, presets

FAMILY = Family("gpt2", hf.ADAPTER, presets=presets.PRESETS)
