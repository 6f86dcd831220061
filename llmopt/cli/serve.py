"""`llmopt serve`: an OpenAI-compatible endpoint on the paged runtime."""

from __future__ import annotations

import json
import os
import shutil

import typer

from llmopt.cli.common import handles_errors
from llmopt.cli.engine_args import EngineArgs, engine_options
from llmopt.errors import LlmoptError

ENGINES = ("llmopt", "llama.cpp", "vllm")


@handles_errors
@engine_options()
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
    engine_args: EngineArgs = EngineArgs(),
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
        argv = vllm_command(model, host, port, api_key, served_model_name, engine_args, tensor_parallel_size,
                            quantization)
        typer.echo("llmopt serve: handing over to " + " ".join(argv), err=True)
        os.execvp(argv[0], argv)  # vLLM owns the process from here (signals, exit code)
    if tensor_parallel_size != 1 or quantization:
        raise LlmoptError("--tensor-parallel-size and --quantization apply to --engine vllm only")
    config = engine_args.engine_config()  # bad flags are reported before any model loads
    import uvicorn

    from llmopt.runtime.engine_protocol import ServingEngine
    from llmopt.serve.app import ServeConfig, build_app

    async_engine: ServingEngine
    if engine == "llama.cpp":
        from llmopt.runtime.llamacpp_engine import LlamaCppEngine

        if config.speculative_config is not None:
            raise LlmoptError("speculative decoding runs on --engine llmopt or vllm, not llama.cpp")
        async_engine = llamacpp = LlamaCppEngine.from_spec(model, max_model_len=engine_args.max_model_len)
        description = f"{llamacpp.gguf_path.name}; engine llama.cpp, one request at a time"
    else:
        from llmopt.core import load
        from llmopt.runtime.async_engine import AsyncLLM

        loaded = load(model, dtype=engine_args.dtype, device=engine_args.device)
        async_engine = llm = AsyncLLM.from_spec(loaded, engine_config=config)
        kv = llm.engine.kv
        kv_dtype = str(llm.engine.kv_cache_dtype).removeprefix("torch.")
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
                 engine_args: EngineArgs, tensor_parallel_size: int = 1, quantization: str | None = None) -> list[str]:
    """`vllm serve` with the flags that mean the same thing there (vLLM checks their values itself)."""
    exe = shutil.which("vllm")
    if exe is None:
        raise LlmoptError("--engine vllm needs vLLM: `pip install vllm` on a machine with a CUDA GPU "
                          "(or use the default --engine llmopt)")
    if model == "default":
        from llmopt.core import resolve

        model = str(resolve("default").path)  # vLLM reads the converted Hugging Face folder
    e = engine_args
    argv = [exe, "serve", model, "--host", host, "--port", str(port), "--max-num-seqs", str(e.max_num_seqs),
            "--max-num-batched-tokens", str(e.max_num_batched_tokens), "--block-size", str(e.block_size),
            "--gpu-memory-utilization", str(e.gpu_memory_utilization),
            "--tensor-parallel-size", str(tensor_parallel_size), "--dtype", e.dtype,
            "--enable-prefix-caching" if e.enable_prefix_caching else "--no-enable-prefix-caching"]
    if e.max_model_len is not None:
        argv += ["--max-model-len", str(e.max_model_len)]
    if quantization:
        argv += ["--quantization", quantization]
    if e.kv_cache_dtype != "auto":  # same flag there; vLLM checks the value against what its version supports
        argv += ["--kv-cache-dtype", e.kv_cache_dtype]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    if api_key:
        argv += ["--api-key", api_key]
    speculative = e.speculative_config()
    if speculative:  # vLLM's own --speculative-config; it has no vocabulary check to override
        speculative.pop("allow_mismatch", None)
        argv += ["--speculative-config", json.dumps(speculative)]
    return argv

