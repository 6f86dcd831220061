"""What every subcommand shares: error handling, JSON output, consoles."""

from __future__ import annotations

import functools
import json
import sys
import traceback
from typing import Any, Callable

import typer
from rich.console import Console

from llmopt.errors import LlmoptError

console = Console()
err_console = Console(stderr=True)

# set by the top-level --debug flag
DEBUG = {"enabled": False}

EXIT_OK, EXIT_GATE_FAILED, EXIT_USAGE = 0, 1, 2


def handles_errors(fn: Callable) -> Callable:
    """Turn bad input (LlmoptError) into one line on stderr and exit code 2.

    With --debug the traceback is printed as well. Anything else is a bug in llmopt and
    keeps its traceback.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LlmoptError as exc:
            if DEBUG["enabled"]:
                traceback.print_exc()
            message = " ".join(str(exc).split())  # exactly one line
            typer.echo(f"error: {message}", err=True)
            raise typer.Exit(EXIT_USAGE) from None
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130) from None

    return wrapper


def print_json(document: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(document, indent=2, default=str) + "\n")
    sys.stdout.flush()


# Engine flags shared by every command that runs the paged runtime (vLLM's names).
MAX_NUM_SEQS = typer.Option(64, "--max-num-seqs", help="Most requests running at once.")
MAX_NUM_BATCHED_TOKENS = typer.Option(1024, "--max-num-batched-tokens", help="Token budget per step.")
MAX_MODEL_LEN = typer.Option(None, "--max-model-len", help="Prompt + output limit (default: the model's context).")
BLOCK_SIZE = typer.Option(16, "--block-size", help="Tokens per KV block.")
PREFIX_CACHING = typer.Option(True, "--enable-prefix-caching/--no-enable-prefix-caching")
KV_CACHE_MEMORY = typer.Option(None, "--kv-cache-memory", help="KV pool size, e.g. 2GiB (CPU default: 10% of free RAM).")
GPU_MEMORY_UTILIZATION = typer.Option(0.9, "--gpu-memory-utilization")
KV_CACHE_DTYPE = typer.Option("auto", "--kv-cache-dtype", help="KV cache element type: auto (the model's dtype), "
                              "bfloat16, float16 or float32; 16-bit on an fp32 model holds twice the tokens.")
DTYPE = typer.Option("auto", "--dtype", help="auto, float32, bfloat16 or float16")
DEVICE = typer.Option("cpu", "--device")


def engine_config(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int | None, block_size: int,
                  enable_prefix_caching: bool, kv_cache_memory: str | None, gpu_memory_utilization: float,
                  kv_cache_dtype: str = "auto"):
    from llmopt.runtime.config import EngineConfig, parse_bytes

    return EngineConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
        block_size=block_size, enable_prefix_caching=enable_prefix_caching,
        kv_cache_memory=parse_bytes(kv_cache_memory) if kv_cache_memory else None,
        gpu_memory_utilization=gpu_memory_utilization, kv_cache_dtype=kv_cache_dtype,
    )
