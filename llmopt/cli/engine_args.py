"""The engine flags (vLLM's names), declared once for every command that runs the paged runtime.

`@engine_options()` appends them to a Typer command's signature (under an "Engine" help panel)
and hands the command one `EngineArgs` in its `engine_args` parameter; `EngineArgs.engine_config()`
builds the runtime's `EngineConfig`. Typer has no option groups of its own, so the decorator
writes the parameters into the signature Typer reads.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, get_type_hints

import typer

from llmopt.runtime.engine_args import EngineArgs

PANEL = "Engine"


# EngineArgs field -> its flag; the default comes from the field
_FLAGS: dict[str, tuple[str, str]] = {
    "max_num_seqs": ("--max-num-seqs", "Most requests running at once."),
    "max_num_batched_tokens": ("--max-num-batched-tokens", "Token budget per step."),
    "max_model_len": ("--max-model-len", "Prompt + output limit (default: the model's context)."),
    "block_size": ("--block-size", "Tokens per KV block."),
    "enable_prefix_caching": ("--enable-prefix-caching/--no-enable-prefix-caching", "Reuse the KV blocks of "
                              "prompt prefixes seen before."),
    "kv_cache_memory": ("--kv-cache-memory", "KV pool size, e.g. 2GiB (CPU default: 10% of free RAM)."),
    "kv_cache_dtype": ("--kv-cache-dtype", "KV cache element type: auto (the model's dtype), bfloat16, float16, "
                       "float32 or fp8 (e4m3); 16-bit on an fp32 model holds twice the tokens, fp8 four times."),
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
