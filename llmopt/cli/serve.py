"""`llmopt serve`: an OpenAI-compatible endpoint on the paged runtime."""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict

import typer

from llmopt.cli.common import (
    BLOCK_SIZE,
    DEVICE,
    DTYPE,
    GPU_MEMORY_UTILIZATION,
    KV_CACHE_DTYPE,
    KV_CACHE_MEMORY,
    MAX_MODEL_LEN,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    PREFIX_CACHING,
    engine_config,
    handles_errors,
)
from llmopt.errors import LlmoptError

ENGINES = ("llmopt", "llama.cpp", "vllm")


@handles_errors
def serve(
    model: str = typer.Argument("default", help="'default', a model folder, a .gguf file or a hub id"),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port"),
    engine: str = typer.Option("llmopt", "--engine", help="Back end: llmopt (our paged runtime), llama.cpp (GGUF files, one request at a time) or vllm (hands over to `vllm serve`)."),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", help="GPUs per model (vllm engine only)."),
    quantization: str | None = typer.Option(None, "--quantization", help="Passed to vllm (awq, gptq, ...)."),
    api_key: str | None = typer.Option(None, "--api-key", help="Require 'Authorization: Bearer KEY' (or set LLMOPT_API_KEY)."),
    served_model_name: str | None = typer.Option(None, "--served-model-name", help="Model name clients use (default: MODEL)."),
    max_queue: int = typer.Option(256, "--max-queue", help="Waiting requests beyond this get 503 + Retry-After."),
    log_requests: bool = typer.Option(False, "--log-requests", help="Log prompt contents."),
    max_num_seqs: int = MAX_NUM_SEQS,
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
    max_model_len: int | None = MAX_MODEL_LEN,
    block_size: int = BLOCK_SIZE,
    enable_prefix_caching: bool = PREFIX_CACHING,
    kv_cache_memory: str | None = KV_CACHE_MEMORY,
    kv_cache_dtype: str = KV_CACHE_DTYPE,
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
    dtype: str = DTYPE,
    device: str = DEVICE,
) -> None:
    """Serve a model over the OpenAI API (chat, completions, streaming, /metrics)."""
    if engine not in ENGINES:
        raise LlmoptError(f"unknown engine {engine!r}; available: {', '.join(ENGINES)}")
    if not 0 < port < 65536:
        raise LlmoptError(f"--port must be 1-65535, got {port}")
    if max_queue < 1:
        raise LlmoptError(f"--max-queue must be positive, got {max_queue}")
    api_key = api_key or os.environ.get("LLMOPT_API_KEY") or None
    if engine == "vllm":
        argv = vllm_command(model, host, port, api_key, served_model_name, max_num_seqs, max_num_batched_tokens,
                            max_model_len, block_size, enable_prefix_caching, gpu_memory_utilization,
                            tensor_parallel_size, quantization, dtype, kv_cache_dtype)
        typer.echo("llmopt serve: handing over to " + " ".join(argv), err=True)
        os.execvp(argv[0], argv)  # vLLM owns the process from here (signals, exit code)
    if tensor_parallel_size != 1 or quantization:
        raise LlmoptError("--tensor-parallel-size and --quantization apply to --engine vllm only")
    import uvicorn

    from llmopt.serve.app import ServeConfig, build_app

    if engine == "llama.cpp":
        async_engine, description = _llamacpp_engine(model, max_model_len)
    else:
        from llmopt.core import load
        from llmopt.runtime.async_engine import AsyncLLM

        config = engine_config(max_num_seqs, max_num_batched_tokens, max_model_len, block_size,
                               enable_prefix_caching, kv_cache_memory, gpu_memory_utilization, kv_cache_dtype)
        loaded = load(model, dtype=dtype, device=device)
        async_engine = AsyncLLM.from_spec(loaded, **asdict(config))
        kv = async_engine.engine.kv
        kv_dtype = str(async_engine.engine.kv_cache_dtype).removeprefix("torch.")
        description = (f"{loaded.config.architecture}, {loaded.dtype}, {loaded.device}; engine llmopt, KV cache "
                       f"{kv.num_blocks} blocks x {kv.block_size} tokens, {kv_dtype}")
    serve_config = ServeConfig(served_model_name=served_model_name or model,
                               api_key=api_key,
                               max_queue=max_queue, log_requests=log_requests)
    app = build_app(async_engine, serve_config)
    typer.echo(
        f"llmopt serve: model {serve_config.served_model_name} ({description}), "
        f"max_model_len {async_engine.max_model_len}, auth {'on' if serve_config.api_key else 'off'}\n"
        f"listening on http://{host}:{port}/v1"
    )
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=10)


def vllm_command(model: str, host: str, port: int, api_key: str | None, served_model_name: str | None,
                 max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int | None, block_size: int,
                 enable_prefix_caching: bool, gpu_memory_utilization: float, tensor_parallel_size: int,
                 quantization: str | None, dtype: str, kv_cache_dtype: str = "auto") -> list[str]:
    """`vllm serve` with the flags that mean the same thing there."""
    exe = shutil.which("vllm")
    if exe is None:
        raise LlmoptError("--engine vllm needs vLLM: `pip install vllm` on a machine with a CUDA GPU "
                          "(or use the default --engine llmopt)")
    if model == "default":
        from llmopt.core import resolve

        model = str(resolve("default").path)  # vLLM reads the converted Hugging Face folder
    argv = [exe, "serve", model, "--host", host, "--port", str(port), "--max-num-seqs", str(max_num_seqs),
            "--max-num-batched-tokens", str(max_num_batched_tokens), "--block-size", str(block_size),
            "--gpu-memory-utilization", str(gpu_memory_utilization),
            "--tensor-parallel-size", str(tensor_parallel_size), "--dtype", dtype,
            "--enable-prefix-caching" if enable_prefix_caching else "--no-enable-prefix-caching"]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    if quantization:
        argv += ["--quantization", quantization]
    if kv_cache_dtype != "auto":  # same flag there; vLLM checks the value against what its version supports
        argv += ["--kv-cache-dtype", kv_cache_dtype]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    if api_key:
        argv += ["--api-key", api_key]
    return argv


def _llamacpp_engine(model: str, max_model_len: int | None):
    from pathlib import Path

    from llmopt.core.embedded import default_gguf_path
    from llmopt.serve.llamacpp_engine import LlamaCppEngine

    path = default_gguf_path() if model == "default" else Path(model).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        raise LlmoptError(f"--engine llama.cpp serves .gguf files; {model!r} is not one")
    engine = LlamaCppEngine(path, max_model_len=max_model_len)
    return engine, f"{path.name}; engine llama.cpp, one request at a time"
