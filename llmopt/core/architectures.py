"""Architecture configs shipped with llmopt: the `config.json` of well-known models, so that
arithmetic about them (`llmopt plan`) needs no download. Keys and values as the models'
own config.json files on the Hugging Face hub."""

from __future__ import annotations

from typing import Any

from llmopt.core.config import ModelConfig

_LLAMA3 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
           "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "bos_token_id": 128000, "eos_token_id": 128001}

SHIPPED: dict[str, dict[str, Any]] = {
    "llama-3-8b": {**_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192,
                   "tie_word_embeddings": False},
    "llama-3-70b": {**_LLAMA3, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                    "num_attention_heads": 64, "num_key_value_heads": 8, "max_position_embeddings": 8192,
                    "tie_word_embeddings": False},
    "llama-3.2-1b": {**_LLAMA3, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                     "max_position_embeddings": 131072, "tie_word_embeddings": True,
                     "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "mistral-7b": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 32000,
                   "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 32768,
                   "sliding_window": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                   "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2},
}


def shipped_config(name: str) -> ModelConfig | None:
    """The shipped config called `name` (e.g. "llama-3-8b"), or None."""
    raw = SHIPPED.get(name.lower())
    return None if raw is None else ModelConfig.from_hf(raw, where=f"shipped architecture {name}")
