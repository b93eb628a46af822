"""tinyformer: a from-scratch, formula-faithful Transformer and mini-LLM toolkit in PyTorch."""

from tinyformer.config import ModelConfig
from tinyformer.errors import TinyformerError

__all__ = ["ModelConfig", "TinyformerError", "__version__"]
__version__ = "0.1.0"
