"""The phi3 family: Phi-3, on the Llama layout with fused q/k/v and gate/up matrices and LongRoPE.

    hf.py       the Hugging Face model type
    gguf.py     llama.cpp's phi3 (LongRoPE factor tensors)

RoPE: half-split everywhere (Hugging Face, llama.cpp's phi3, tinyformer): no permutation.
"""

from tinyformer.families.family import Family
from tinyformer.families.phi3 import gguf, hf

FAMILY = Family("phi3", hf.ADAPTER, gguf=(gguf.ARCH,), gguf_arch_for=hf.LAYOUT.gguf_arch_for)
