"""Model files without the model: specs resolved to sources (`resolve`), configs, tokenizers
(`load_tokenizer`), checkpoint formats and weights I/O. `llmopt.loader` builds the model on top."""

from llmopt.core.config import ModelConfig
from llmopt.core.quantization_info import QuantizationInfo
from llmopt.core.source import ModelSource, load_tokenizer, resolve
from llmopt.core.tokenizer import Tokenizer

__all__ = ["ModelConfig", "ModelSource", "QuantizationInfo", "Tokenizer", "load_tokenizer", "resolve"]
