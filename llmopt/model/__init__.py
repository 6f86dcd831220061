"""Our Llama-family decoder and its layers."""

from llmopt.model.attention import AttentionBackend, ContiguousKVCache
from llmopt.model.llama import LlamaForCausalLM

__all__ = ["AttentionBackend", "ContiguousKVCache", "LlamaForCausalLM"]
