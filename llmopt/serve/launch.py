"""`llmopt serve` as a library call: `ServeArgs` (its options, declared once: the command's flags
and a recipe's `serve` section) -> `run_server`, which serves until the process is stopped, or
hands the process to `vllm serve` (`--engine vllm`)."""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from typing import Optional

from llmopt.errors import LlmoptError
from llmopt.options import group, option
from llmopt.runtime.engine_args import EngineArgs

ENGINES = ("llmopt", "llama.cpp", "vllm")
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")  # llmopt.serve.tools.FORMATS, kept import-light
log = logging.getLogger("llmopt")


@dataclass
class ServeArgs:
    """The options of `llmopt serve`."""

    model: str = option("default", "'default', a model folder, a .gguf file or a hub id", argument=True,
                        recipe=None)
    host: str = option("127.0.0.1", "Address to listen on.")
    port: int = option(8000, "Port to listen on.", gt=0, lt=65536)
    engine_name: str = option("llmopt", "Back end: llmopt (our paged runtime), llama.cpp (GGUF files, one request "
                              "at a time) or vllm (hands over to `vllm serve`).", "--engine", recipe="engine",
                              choices=ENGINES)
    tensor_parallel_size: int = option(1, "GPUs per model (vllm engine only).", ge=1)
    api_key: Optional[str] = option(None, "Require 'Authorization: Bearer KEY' (or set LLMOPT_API_KEY).",
                                    recipe=None)
    served_model_name: Optional[str] = option(None, "Model name clients use (default: MODEL).")
    max_queue: int = option(256, "Waiting sequences (prompts x n) beyond this get 503 + Retry-After; a request "
                            "asking for more than this at once gets 400.", ge=1)
    max_prompts_per_request: int = option(64, "Prompts one request may hold (a completions prompt list); more get "
                                          "400.", ge=1)
    prepare_timeout: float = option(10.0, "Seconds to render, tokenize and compile the output constraint of a "
                                    "request (on worker threads, off the event loop); longer gets 400.", gt=0)
    read_timeout: float = option(30.0, "Seconds a client has to send a request's headers (then the connection is "
                                 "closed) and again its body (then 408).", gt=0)
    timeout_keep_alive: float = option(5.0, "Seconds an idle keep-alive connection stays open (uvicorn's "
                                       "--timeout-keep-alive).", gt=0)
    log_requests: bool = option(False, "Log prompt contents.", "--log-requests")
    tool_call_parser: Optional[str] = option(
        None, "How the model writes tool calls: hermes (also Qwen2.5), llama3_json or mistral (vLLM's names; "
        "default: from the chat template, hermes for templates without tools).", choices=TOOL_CALL_PARSERS)
    enable_auto_tool_choice: bool = option(False, "Allow tool_choice \"auto\" (the model decides whether to call; "
                                           "the call is still held to its schema).", "--enable-auto-tool-choice")
    engine: EngineArgs = group(EngineArgs)

    def check(self) -> None:
        """What is wrong with the options alone (LlmoptError), before any model loads."""
        if self.engine_name not in ENGINES:
            raise LlmoptError(f"unknown engine {self.engine_name!r}; available: {', '.join(ENGINES)}")
        if not 0 < self.port < 65536:
            raise LlmoptError(f"--port must be 1-65535, got {self.port}")
        for flag, value in (("--max-queue", self.max_queue), ("--max-prompts-per-request", self.max_prompts_per_request),
                            ("--prepare-timeout", self.prepare_timeout), ("--read-timeout", self.read_timeout),
                            ("--timeout-keep-alive", self.timeout_keep_alive)):
            if not value > 0:  # NaN too
                raise LlmoptError(f"{flag} must be positive, got {value}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise LlmoptError(f"unknown --tool-call-parser {self.tool_call_parser!r}; available: "
                              f"{', '.join(TOOL_CALL_PARSERS)}")
        if self.engine_name != "vllm":
            if self.tensor_parallel_size != 1:
                raise LlmoptError("--tensor-parallel-size applies to --engine vllm only")
            if self.engine_name == "llama.cpp" and self.engine.quantization:
                raise LlmoptError("--quantization applies to --engine llmopt and vllm, not llama.cpp (a GGUF file "
                                  "names its own types)")
            config = self.engine.engine_config()
            if self.engine_name == "llama.cpp" and config.speculative_config is not None:
                raise LlmoptError("speculative decoding runs on --engine llmopt or vllm, not llama.cpp")


def run_server(args: ServeArgs, announce=print) -> None:
    """Serve `args.model` over the OpenAI API until stopped; `announce(line)` tells where it listens."""
    args.check()
    api_key = args.api_key or os.environ.get("LLMOPT_API_KEY") or None
    if args.engine_name == "vllm":
        argv = vllm_command(args, api_key)
        announce("llmopt serve: handing over to " + " ".join(argv))
        os.execvp(argv[0], argv)  # vLLM owns the process from here (signals, exit code)
    import uvicorn

    from llmopt.runtime.engine_protocol import ServingEngine
    from llmopt.serve.app import ServeConfig, build_app
    from llmopt.serve.http_timeouts import uvicorn_protocol

    async_engine: ServingEngine
    if args.engine_name == "llama.cpp":
        from llmopt.runtime.llamacpp_engine import LlamaCppEngine

        async_engine = llamacpp = LlamaCppEngine.from_spec(args.model, max_model_len=args.engine.max_model_len)
        description = f"{llamacpp.gguf_path.name}; engine llama.cpp, one request at a time"
    else:
        from llmopt.loader import load
        from llmopt.runtime.async_engine import AsyncLLM

        loaded = load(args.model, dtype=args.engine.dtype, device=args.engine.device,
                      load_format=args.engine.load_format, quantization=args.engine.quantization)
        async_engine = llm = AsyncLLM.from_spec(loaded, engine_config=args.engine.engine_config())
        kv = llm.engine.kv
        kv_dtype = str(llm.engine.kv_cache_dtype).removeprefix("torch.")
        description = (f"{loaded.config.architecture}, {loaded.dtype}, {loaded.device}; engine llmopt, KV cache "
                       f"{kv.num_blocks} blocks x {kv.block_size} tokens, {kv_dtype}")
    serve_config = ServeConfig(served_model_name=args.served_model_name or args.model, api_key=api_key,
                               max_queue=args.max_queue, max_prompts_per_request=args.max_prompts_per_request,
                               read_timeout=args.read_timeout, prepare_timeout=args.prepare_timeout,
                               log_requests=args.log_requests, tool_call_parser=args.tool_call_parser,
                               enable_auto_tool_choice=args.enable_auto_tool_choice)
    app = build_app(async_engine, serve_config)
    announce(f"llmopt serve: model {serve_config.served_model_name} ({description}), "
             f"max_model_len {async_engine.max_model_len}, auth {'on' if serve_config.api_key else 'off'}\n"
             f"listening on http://{args.host}:{args.port}/v1")
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=10,
                timeout_keep_alive=args.timeout_keep_alive, http=uvicorn_protocol(args.read_timeout))


def vllm_command(args: ServeArgs, api_key: str | None = None) -> list[str]:
    """`vllm serve` with the flags that mean the same thing there (vLLM checks their values itself)."""
    exe = shutil.which("vllm")
    if exe is None:
        raise LlmoptError("--engine vllm needs vLLM: `pip install vllm` on a machine with a CUDA GPU "
                          "(or use the default --engine llmopt)")
    model = args.model
    if model == "default":
        from llmopt.core import resolve

        model = str(resolve("default").path)  # vLLM reads the converted Hugging Face folder
    e = args.engine
    argv = [exe, "serve", model, "--host", args.host, "--port", str(args.port), "--max-num-seqs", str(e.max_num_seqs),
            "--max-num-batched-tokens", str(e.max_num_batched_tokens), "--block-size", str(e.block_size),
            "--gpu-memory-utilization", str(e.gpu_memory_utilization),
            "--tensor-parallel-size", str(args.tensor_parallel_size), "--dtype", e.dtype,
            "--enable-prefix-caching" if e.enable_prefix_caching else "--no-enable-prefix-caching"]
    if e.max_model_len is not None:
        argv += ["--max-model-len", str(e.max_model_len)]
    if e.quantization:  # vLLM's own flag (any of its methods: llmopt's runtime takes awq and gptq)
        argv += ["--quantization", e.quantization]
    if e.load_format != "auto":  # vLLM's own flag and value
        argv += ["--load-format", e.load_format]
    if e.kv_cache_dtype != "auto":  # same flag there; vLLM checks the value against what its version supports
        argv += ["--kv-cache-dtype", e.kv_cache_dtype]
    if e.enforce_eager:  # vLLM's own flag (--max-seq-len-to-capture is not passed: newer vLLMs dropped it)
        argv += ["--enforce-eager"]
    if args.served_model_name:
        argv += ["--served-model-name", args.served_model_name]
    if api_key:
        argv += ["--api-key", api_key]
    if args.tool_call_parser:
        argv += ["--tool-call-parser", args.tool_call_parser]
    if args.enable_auto_tool_choice:
        argv += ["--enable-auto-tool-choice"]
    speculative = e.speculative_flags()
    if speculative:  # vLLM's own --speculative-config; it has no vocabulary check to override
        speculative.pop("allow_mismatch", None)
        argv += ["--speculative-config", json.dumps(speculative)]
    return argv
