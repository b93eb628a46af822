"""Checkpoint interop, the parts no model family owns: Hugging Face folders and GGUF files in, Hugging Face folders,
GGUF files and PEFT adapters out.

    hf_folder.py        HF folder <-> run folder, streaming tensor by tensor (import_hf, export_hf); sentence-
                        transformers folders in
    tensor_sources.py   checkpoints on disk as named tensors read one at a time (safetensors shards, .bin)
    convert_pipeline.py check / plan / write into a staging folder, shared by every conversion
    gguf.py             the GGUF reader: llama.cpp GGUF -> run folder (dequantize, undo the q/k permutation, tokenizer)
    gguf_export.py      the GGUF writer: run folder -> GGUF (metadata, q/k permutation, quantization, tokenizer)
    peft.py             LoRA run -> merged run folder or PEFT adapter folder

What differs between architectures (config keys, tensor names, GGUF metadata and names, RoPE convention) lives in
``families/<family>/``, found through the registry ``families/__init__.py``. The command line is
``tinyformer convert`` (cli/convert.py).
"""
