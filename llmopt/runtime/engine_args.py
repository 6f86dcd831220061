"""`EngineArgs`: the engine flags of a command line or a recipe (vLLM's names), and the one place
they become the runtime's `EngineConfig`.

`EngineArgs` is an `EngineConfig` whose every declared option (`engine_option`) is a flag, plus
what only a command line states: the model's dtype, device, load format and quantization, the KV pool size as text, and the
speculative-decoding flags that become vLLM's `speculative_config`. The CLI derives the flags
(`llmopt.cli.options.request_options`), the recipe schema its engine keys (`section_model`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

from llmopt.core.device import DEVICE_HELP
from llmopt.errors import LlmoptError
from llmopt.runtime.config import EngineConfig, engine_option, parse_bytes

_SPECULATIVE_KEYS = {"speculative_model": "model", "speculative_method": "method",
                     "num_speculative_tokens": "num_speculative_tokens", "prompt_lookup_min": "prompt_lookup_min",
                     "prompt_lookup_max": "prompt_lookup_max",
                     "speculative_disable_by_batch_size": "disable_by_batch_size"}


@dataclass
class EngineArgs(EngineConfig):
    """The engine flags of one command line (the defaults are the flags' defaults)."""

    kv_cache_memory: Optional[str] = engine_option(None, "KV pool size, e.g. 2GiB (CPU default: 10% of free RAM).")
    dtype: str = engine_option("auto", "auto, float32, bfloat16 or float16")
    device: str = engine_option("auto", DEVICE_HELP)
    load_format: str = engine_option(
        "auto", "auto: the checkpoint's weights; dummy: random weights of the model's shape, nothing read "
        "(a shipped architecture such as llama-3-8b works as the model).", choices=("auto", "dummy"))
    quantization: Optional[str] = engine_option(
        None, "awq or gptq (vLLM's flag). With --load-format dummy: random int4 weights packed as that format's "
        "checkpoint, run on the same int4 kernels as a real one; with a checkpoint it must name the checkpoint's "
        "own method (serve --engine vllm passes any of vLLM's methods on).")
    speculative_model: Optional[str] = engine_option(
        None, "Speculative decoding with this draft model (same tokenizer as the target; a smaller or int4 "
        "checkpoint), e.g. an AWQ folder.")
    speculative_method: Optional[str] = engine_option(
        None, "ngram: speculate by prompt lookup (no draft model); draft_model: with --speculative-model.",
        choices=("ngram", "draft_model"))
    num_speculative_tokens: Optional[int] = engine_option(
        None, "Tokens proposed per step, verified in one forward (default 4).", ge=1)
    prompt_lookup_min: Optional[int] = engine_option(
        None, "ngram: shortest suffix matched in the request's tokens (default 2).", ge=1)
    prompt_lookup_max: Optional[int] = engine_option(None, "ngram: longest suffix matched (default 5).", ge=1)
    speculative_disable_by_batch_size: Optional[int] = engine_option(
        None, "No proposals while more requests than this are running.", ge=1)
    speculative_allow_mismatch: bool = engine_option(
        False, "Start a draft whose token ids mean other tokens than the target's (refused otherwise).")

    def __post_init__(self) -> None:
        pass  # flags are checked when they become an EngineConfig (`engine_config`), with the flags' names

    def speculative_flags(self) -> Optional[dict[str, Any]]:
        """vLLM's speculative_config from the speculative flags (None: no speculation)."""
        given = {name: getattr(self, name) for name in _SPECULATIVE_KEYS if getattr(self, name) is not None}
        if self.speculative_allow_mismatch:
            given["speculative_allow_mismatch"] = True
        if not given:
            return None
        if self.speculative_model is None and self.speculative_method is None:
            named = ", ".join("--" + name.replace("_", "-") for name in given)
            raise LlmoptError(f"{named}: speculative decoding needs --speculative-model SPEC or "
                              "--speculative-method ngram")
        return {_SPECULATIVE_KEYS.get(name, "allow_mismatch"): value for name, value in given.items()}

    def engine_config(self) -> EngineConfig:
        """The runtime's EngineConfig; LlmoptError (exit 2) for a bad value."""
        values = {f.name: getattr(self, f.name) for f in fields(EngineConfig)}
        values["kv_cache_memory"] = parse_bytes(self.kv_cache_memory) if self.kv_cache_memory else None
        values["speculative_config"] = self.speculative_flags()
        return EngineConfig(**values)
