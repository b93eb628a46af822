"""The gemma family: Gemma 2 and Gemma 3 (text), on the Llama layout's names.

    hf.py       HF config.json <-> ModelConfig (sandwich norms, 1 + g gains, soft-caps, local/global layers), names
    gguf.py     llama.cpp's gemma2 and gemma3 (gains stored as 1 + g, llama.cpp's fixed layer pattern)

RoPE: half-split everywhere (Hugging Face, llama.cpp's Gemma, tinyformer): no permutation.
"""

from tinyformer.config import ModelConfig
from tinyformer.families.family import Family
from tinyformer.families.gemma import gguf, hf


def gguf_arch_for(cfg: ModelConfig) -> str:
    return hf.TYPES[hf.export_model_type(cfg)].gguf_arch


FAMILY = Family("gemma", hf.ADAPTER, gguf=tuple(gguf.ARCHS.values()), gguf_arch_for=gguf_arch_for)
