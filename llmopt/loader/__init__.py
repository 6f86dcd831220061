"""Builds the model a spec names: `load(spec)` -> `LoadedModel` (config, tokenizer, our decoder on
its kernel backend). Sits between the runtime and the model: runtime -> loader -> model -> core."""

from llmopt.loader.build import build_model
from llmopt.loader.model_loader import LoadedModel, load, resolve_dtype

__all__ = ["LoadedModel", "build_model", "load", "resolve_dtype"]
