"""The one model-loading core: every subcommand gets its model through `resolve` + `load`."""

from llmopt.core.config import ModelConfig
from llmopt.core.loader import LoadedModel, load, load_tokenizer
from llmopt.core.source import ModelSource, QuantizationInfo, resolve
from llmopt.core.tokenizer import Tokenizer

__all__ = ["LoadedModel", "ModelConfig", "ModelSource", "QuantizationInfo", "Tokenizer", "load", "load_tokenizer", "resolve"]
