"""The llama family: Llama 1/2/3, Mistral and Mixtral, on the Llama layout that the qwen, phi3 and gemma families
build on.

    hf.py       the Llama layout (HF config.json <-> ModelConfig, HF tensor names) and its Llama, Mistral, Mixtral types
    gguf.py     llama.cpp's names and shared metadata keys; the ``llama`` architecture (Mixtral with experts)
    presets.py  llama-7b, llama2-7b/13b/70b, llama3-8b, llama3.1-8b

RoPE: Hugging Face and tinyformer rotate half-split pairs (i, i + d_head/2); llama.cpp's ``llama`` rotates adjacent
pairs, so W_q / W_k rows are permuted at the GGUF file boundary only (``rope_interleaved``).
"""

from tinyformer.families.family import Family
from tinyformer.families.llama import gguf, hf, presets

FAMILY = Family("llama", hf.ADAPTER, gguf=(gguf.ARCH,), gguf_arch_for=hf.LAYOUT.gguf_arch_for, presets=presets.PRESETS)
