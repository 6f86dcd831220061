"""The engine flags (vLLM's names), declared once for every command that runs the paged runtime.

`@engine_options()` appends them to a Typer command's signature (under an "Engine" help panel)
and hands the command one `EngineArgs` in its `engine_args` parameter; `EngineArgs.engine_config()`
builds the runtime's `EngineConfig`. Typer has no option groups of its own, so the decorator
writes the parameters into the signature Typer reads.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, get_type_hints

import typer

if TYPE_CHECKING:
    from llmopt.runtime.config import EngineConfig

PANEL = "Engine"


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
            from llmopt.errors import LlmoptError

            named = ", ".join(_FLAGS[name][0].split("/")[0] for name in given)
            raise LlmoptError(f"{named}: speculative decoding needs --speculative-model SPEC or "
                              "--speculative-method ngram")
        return {fields.get(name, "allow_mismatch"): value for name, value in given.items()}

    def engine_config(self) -> "EngineConfig":
        """The runtime's EngineConfig; LlmoptError (exit 2) for a bad value."""
        from llmopt.runtime.config import EngineConfig, parse_bytes

        return EngineConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len, block_size=self.block_size,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_cache_memory=parse_bytes(self.kv_cache_memory) if self.kv_cache_memory else None,
            gpu_memory_utilization=self.gpu_memory_utilization, kv_cache_dtype=self.kv_cache_dtype,
            speculative_config=self.speculative_config(),
        )


# EngineArgs field -> its flag; the default comes from the field
_FLAGS: dict[str, tuple[str, str]] = {
    "max_num_seqs": ("--max-num-seqs", "Most requests running at once."),
    "max_num_batched_tokens": ("--max-num-batched-tokens", "Token budget per step."),
    "max_model_len": ("--max-model-len", "Prompt + output limit (default: the model's context)."),
    "block_size": ("--block-size", "Tokens per KV block."),
    "enable_prefix_caching": ("--enable-prefix-caching/--no-enable-prefix-caching", "Reuse the KV blocks of "
                              "prompt prefixes seen before."),
    "kv_cache_memory": ("--kv-cache-memory", "KV pool size, e.g. 2GiB (CPU default: 10% of free RAM)."),
    "kv_cache_dtype": ("--kv-cache-dtype", "KV cache element type: auto (the model's dtype), bfloat16, float16 or "
                       "float32; 16-bit on an fp32 model holds twice the tokens."),
    "gpu_memory_utilization": ("--gpu-memory-utilization", "GPU: fraction of device memory llmopt may use in all."),
    "dtype": ("--dtype", "auto, float32, bfloat16 or float16"),
    "device": ("--device", "cpu, cuda or cuda:N"),
    "speculative_model": ("--speculative-model", "Speculative decoding with this draft model (same tokenizer as "
                          "the target; a smaller or int4 checkpoint), e.g. an AWQ folder."),
    "speculative_method": ("--speculative-method", "ngram: speculate by prompt lookup (no draft model); "
                           "draft_model: with --speculative-model."),
    "num_speculative_tokens": ("--num-speculative-tokens", "Tokens proposed per step, verified in one forward "
                               "(default 4)."),
    "prompt_lookup_min": ("--prompt-lookup-min", "ngram: shortest suffix matched in the request's tokens (default 2)."),
    "prompt_lookup_max": ("--prompt-lookup-max", "ngram: longest suffix matched (default 5)."),
    "speculative_disable_by_batch_size": ("--speculative-disable-by-batch-size", "No proposals while more "
                                          "requests than this are running."),
    "speculative_allow_mismatch": ("--speculative-allow-mismatch/--no-speculative-allow-mismatch", "Start a draft "
                                   "whose token ids mean other tokens than the target's (refused otherwise)."),
}


def engine_options(exclude: tuple[str, ...] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a Typer command the engine flags (all but `exclude`, which keep EngineArgs' defaults);
    the command takes them as `engine_args: EngineArgs`."""
    unknown = set(exclude) - set(_FLAGS)
    if unknown:
        raise ValueError(f"not engine flags: {sorted(unknown)}")
    names = [name for name in _FLAGS if name not in exclude]
    types = get_type_hints(EngineArgs)  # type objects: Typer would read strings in the command's module
    defaults = EngineArgs()

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(command)
        if "engine_args" not in signature.parameters:
            raise TypeError(f"{command.__name__} must take an engine_args parameter")
        added = []
        for name in names:
            flag, help_text = _FLAGS[name]
            option = typer.Option(getattr(defaults, name), flag, help=help_text, rich_help_panel=PANEL)
            added.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                           annotation=types[name]))

        @functools.wraps(command)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            flags = {name: kwargs.pop(name) for name in names}
            return command(*args, engine_args=EngineArgs(**flags), **kwargs)

        own = [p for p in signature.parameters.values() if p.name != "engine_args"]
        wrapper.__signature__ = signature.replace(parameters=own + added)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {**{k: v for k, v in command.__annotations__.items() if k != "engine_args"},
                                   **{p.name: p.annotation for p in added}}
        return wrapper

    return decorate
