"""The qwen family: Qwen2, Qwen3 and Qwen3-MoE, on the Llama layout.

    hf.py       the three Hugging Face model types (biases, q/k norms, per-layer windows, experts' names)
    gguf.py     llama.cpp's qwen2, qwen3 and qwen3moe

RoPE: half-split everywhere (Hugging Face, llama.cpp's "neox" rotation, tinyformer): no permutation.
"""

from tinyformer.families.family import Family
from tinyformer.families.qwen import gguf, hf

FAMILY = Family("qwen", hf.ADAPTER, gguf=(gguf.QWEN2_ARCH, gguf.QWEN3_ARCH, gguf.QWEN3MOE_ARCH),
                gguf_arch_for=hf.LAYOUT.gguf_arch_for)
