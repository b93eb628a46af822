"""Checkpoint interop: Hugging Face folders and GGUF files in, Hugging Face folders out.

    adapter.py          the Adapter interface and registry (one adapter per architecture family)
    llama.py            Llama 1/2/3, Mistral, Qwen2 (RoPE half-split on both sides)
    gpt2.py, bert.py    GPT-2, BERT
    hf_folder.py        HF folder <-> run folder, streaming tensor by tensor (import_hf, export_hf)
    tensor_sources.py   checkpoints on disk as named tensors read one at a time (safetensors shards, .bin)
    convert_pipeline.py check / plan / write into a staging folder, shared by every conversion
    gguf.py             llama.cpp GGUF -> run folder (dequantize, undo the q/k permutation, tokenizer)
    safetensors_io.py   safetensors reading and planned, unbuffered writing

The command line is ``tinyformer convert`` (cli/convert.py).
"""
