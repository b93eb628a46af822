"""The bert family: BERT (``BertModel``, ``BertForMaskedLM``, ``BertForPreTraining``) and sentence-transformers
folders.

    hf.py                    HF config.json <-> ModelConfig (an encoder), tensor names, pooler and masked-LM head
    sentence_transformers.py a sentence-transformers folder's modules and pooling
    presets.py               bert-base, bert-tiny

Learned positions: no RoPE, so no rotation convention. No GGUF mapping.
"""

from tinyformer.families.bert import hf, presets
from tinyformer.families.family import Family

FAMILY = Family("bert", hf.ADAPTER, presets=presets.PRESETS)
