"""`EngineArgs`: the engine flags of a command line or a recipe (vLLM's names), and the one place
they become the runtime's `EngineConfig` (`llmopt/cli/engine_args.py` turns them into flags)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from llmopt.errors import LlmoptError
from llmopt.runtime.config import EngineConfig, parse_bytes


@dataclass
class EngineArgs:
    """The engine flags of one command line (the defaults are the flags' defaults)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: Optional[int] = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory: Optional[str] = None
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    dtype: str = "auto"
    device: str = "cpu"
    speculative_model: Optional[str] = None
    speculative_method: Optional[str] = None
    num_speculative_tokens: Optional[int] = None
    prompt_lookup_min: Optional[int] = None
    prompt_lookup_max: Optional[int] = None
    speculative_disable_by_batch_size: Optional[int] = None
    speculative_allow_mismatch: bool = False

    def speculative_config(self) -> Optional[dict[str, Any]]:
        """vLLM's speculative_config from the speculative flags (None: no speculation)."""
        fields = {"speculative_model": "model", "speculative_method": "method",
                  "num_speculative_tokens": "num_speculative_tokens", "prompt_lookup_min": "prompt_lookup_min",
                  "prompt_lookup_max": "prompt_lookup_max",
                  "speculative_disable_by_batch_size": "disable_by_batch_size"}
        given = {name: getattr(self, name) for name in fields if getattr(self, name) is not None}
        if self.speculative_allow_mismatch:
            given["speculative_allow_mismatch"] = True
        if not given:
            return None
        if self.speculative_model is None and self.speculative_method is None:
            named = ", ".join("--" + name.replace("_", "-") for name in given)
            raise LlmoptError(f"{named}: speculative decoding needs --speculative-model SPEC or "
                              "--speculative-method ngram")
        return {fields.get(name, "allow_mismatch"): value for name, value in given.items()}

    def engine_config(self) -> EngineConfig:
        """The runtime's EngineConfig; LlmoptError (exit 2) for a bad value."""
        return EngineConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len, block_size=self.block_size,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_cache_memory=parse_bytes(self.kv_cache_memory) if self.kv_cache_memory else None,
            gpu_memory_utilization=self.gpu_memory_utilization, kv_cache_dtype=self.kv_cache_dtype,
            speculative_config=self.speculative_config(),
        )
