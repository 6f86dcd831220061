"""`llmopt generate` as a library call: `GenerateArgs` (its options, declared once) ->
`run_generate` -> a `GenerateResult` (one record per prompt and a summary).

Prompts run continuously batched on the paged runtime (`LLM`), or one at a time in arrival
order on llama-cpp-python (`--engine llama.cpp`, `LlamaCppEngine`); both are `ServingEngine`s
here, driven to completion by `generate_all`.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from llmopt.errors import LlmoptError
from llmopt.options import group, option
from llmopt.runtime.engine_args import EngineArgs
from llmopt.runtime.outputs import RequestOutput
from llmopt.runtime.sampling_params import SamplingParams
from llmopt.runtime.engine_protocol import ServingEngine

ENGINES = ("llmopt", "llama.cpp")
SAMPLING = "Sampling"


@dataclass
class GenerateArgs:
    """The options of `llmopt generate`."""

    model: str = option("default", "'default', a model folder, a .gguf file or a hub id", argument=True)
    prompt: list[str] = option(help="A prompt (a user message for chat models); repeatable. Without any "
                               "prompt: one sample from the BOS token alone (as transformers' generate()).",
                               names=("--prompt", "-p"), default_factory=list)
    prompts_file: Optional[Path] = option(None, ".txt (a prompt per line) or .jsonl ({\"prompt\"} or "
                                          "{\"messages\"}).", "--prompts-file", "-f")
    system: Optional[str] = option(None, "System message (chat models).")
    chat: Optional[bool] = option(None, "Apply the chat template (default: when the model has one).")
    max_tokens: int = option(256, "Most tokens to generate per prompt.", "--max-tokens", "-n", panel=SAMPLING)
    temperature: float = option(0.8, "0 = greedy.", "--temperature", "-t", panel=SAMPLING)
    top_p: float = option(0.95, "Nucleus sampling: the smallest set of tokens with this probability.", panel=SAMPLING)
    top_k: int = option(40, "0 = off.", panel=SAMPLING)
    min_p: float = option(0.0, "Drop tokens below this fraction of the top token's probability.", panel=SAMPLING)
    seed: Optional[int] = option(None, "Make sampling reproducible.", panel=SAMPLING)
    stop: list[str] = option(help="Stop string; repeatable.", names=("--stop",), default_factory=list,
                             panel=SAMPLING)
    presence_penalty: float = option(0.0, "Penalty for tokens already generated (OpenAI's).", panel=SAMPLING)
    frequency_penalty: float = option(0.0, "Penalty per occurrence of a generated token (OpenAI's).",
                                      panel=SAMPLING)
    repetition_penalty: float = option(1.0, "Divides the logits of tokens seen before (1 = off).", panel=SAMPLING)
    ignore_eos: bool = option(False, "Keep going past end-of-sequence.", "--ignore-eos", panel=SAMPLING)
    engine_name: str = option("llmopt", "llmopt (our paged runtime) or llama.cpp (a .gguf file through "
                              "llama-cpp-python, one request at a time).", "--engine")
    engine: EngineArgs = group(EngineArgs)

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, min_p=self.min_p, seed=self.seed, stop=self.stop or None,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty, ignore_eos=self.ignore_eos)

    def prompts(self) -> list[Any]:
        """The prompts given (none: `run_generate` starts one sample from the BOS token)."""
        prompts: list[Any] = list(self.prompt) + (read_prompts_file(self.prompts_file) if self.prompts_file else [])
        if self.prompts_file and not prompts:
            raise LlmoptError(f"{self.prompts_file} holds no prompt")
        if len(prompts) == 1 and isinstance(prompts[0], str) and not prompts[0].strip():
            raise LlmoptError("--prompt is empty")
        return prompts


@dataclass
class GenerateResult:
    records: list[dict[str, Any]]  # per prompt: text, finish reason, error, token ids, metrics
    summary: dict[str, Any]  # throughput, decode rate, the engine's counters
    failed: list[tuple[int, str]] = field(default_factory=list)  # (prompt index, error)


def run_generate(args: GenerateArgs) -> GenerateResult:
    """Every prompt of `args` to completion on the engine it names; LlmoptError (exit 2) for bad input."""
    prompts = args.prompts()
    params = args.sampling_params()
    config = args.engine.engine_config()  # bad flags are reported before any model loads
    if args.engine_name not in ENGINES:
        raise LlmoptError(f"unknown engine {args.engine_name!r}; choose llmopt or llama.cpp")
    if args.engine_name == "llama.cpp":
        from llmopt.runtime.llamacpp_engine import LlamaCppEngine

        if config.speculative_config is not None:
            raise LlmoptError("speculative decoding runs on --engine llmopt, not llama.cpp")
        engine: ServingEngine = LlamaCppEngine.from_spec(args.model, max_model_len=args.engine.max_model_len)
    else:
        from llmopt.loader import load
        from llmopt.runtime.llm import LLM

        loaded = load(args.model, dtype=args.engine.dtype, device=args.engine.device,
                      load_format=args.engine.load_format, quantization=args.engine.quantization)
        prompts = prompts or [_bos_prompt(loaded.tokenizer)]  # before the KV cache is allocated
        llm = LLM(loaded, engine_config=config)
        engine = llm.engine
    use_chat = engine.tokenizer.is_chat if args.chat is None else args.chat
    if args.system and not use_chat:
        raise LlmoptError("--system needs the chat template; drop --no-chat")
    prompts = prompts or [_bos_prompt(engine.tokenizer)]
    requests = [_as_request(p, use_chat, args.system) for p in prompts]
    start = time.perf_counter()
    outputs = llm.generate(requests, params) if args.engine_name == "llmopt" else generate_all(engine, requests, params)
    elapsed = time.perf_counter() - start
    records = [_record(i, p, o) for i, (p, o) in enumerate(zip(prompts, outputs))]
    return GenerateResult(records, _summary(args.model, use_chat, outputs, elapsed, engine),
                          [(i, o.error) for i, o in enumerate(outputs) if o.error])


def generate_all(engine: ServingEngine, requests: list[Any], params: SamplingParams) -> list[RequestOutput]:
    """Each request's final output through a streaming engine, in one event loop of our own."""

    async def run_all() -> list[RequestOutput]:
        async def final(prompt: Any) -> RequestOutput:
            try:
                request_id = engine.add_request(prompt, params)
            except LlmoptError as exc:
                from llmopt.runtime.llm import rejected_output

                return rejected_output("rejected", prompt, str(exc))
            last = None
            async for out in engine.stream_outputs(request_id):
                last = out
            return last

        return await asyncio.gather(*(final(p) for p in requests))

    return asyncio.run(run_all())


def read_prompts_file(path: Path) -> list[Any]:
    """.txt: one prompt per non-empty line; .jsonl: {"prompt": ...} or {"messages": [...]} per line."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LlmoptError(f"prompts file {path} does not exist") from None
    except UnicodeDecodeError:
        raise LlmoptError(f"prompts file {path} is not UTF-8 text") from None
    if path.suffix != ".jsonl":
        return [line for line in text.splitlines() if line.strip()]
    prompts: list[Any] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise LlmoptError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        if isinstance(item, str):
            prompts.append(item)
        elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
            prompts.append(item["prompt"])
        elif isinstance(item, dict) and isinstance(item.get("messages"), list):
            prompts.append({"messages": item["messages"]})
        else:
            raise LlmoptError(f"{path}:{lineno}: expected a string, {{\"prompt\": str}} or {{\"messages\": [...]}}")
    return prompts


def _bos_prompt(tokenizer: Any) -> dict[str, Any]:
    """The prompt of an unconditional sample (no prompt given): the BOS token alone, no template."""
    bos = tokenizer.token_to_id(tokenizer.bos_token)
    if bos is None:
        raise LlmoptError("give a prompt with --prompt or a file with --prompts-file "
                          "(this model's tokenizer has no BOS token to start a sample from)")
    return {"prompt_token_ids": [bos]}


def _as_request(prompt: Any, use_chat: bool, system: str | None) -> Any:
    if isinstance(prompt, dict) or not use_chat:  # chat messages from a .jsonl file, or plain text
        return prompt
    if not prompt.strip():
        return ""  # rejected by the engine as an empty prompt, for this request only
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return {"messages": messages}


def _record(index: int, prompt: Any, out: RequestOutput) -> dict[str, Any]:
    return {
        "index": index,
        "prompt": prompt if isinstance(prompt, str) else prompt.get("messages", prompt.get("prompt")),
        "text": out.outputs[0].text,
        "finish_reason": out.outputs[0].finish_reason,
        "error": out.error,
        "num_prompt_tokens": len(out.prompt_token_ids),
        "num_cached_tokens": out.num_cached_tokens,
        "num_generated_tokens": len(out.outputs[0].token_ids),
        "prompt_token_ids": out.prompt_token_ids,
        "token_ids": out.outputs[0].token_ids,
        "metrics": out.metrics.to_dict(),
    }


def _summary(model: str, use_chat: bool, outputs: list[RequestOutput], elapsed: float,
             engine: ServingEngine) -> dict[str, Any]:
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    # decode speed of a request: its tokens after the first over the time after the first (llama.cpp's
    # "eval" rate); pooled over requests, so with --max-num-seqs 1 it is batch-1 decode
    decoded = [(len(o.outputs[0].token_ids) - 1, o.metrics.finished_time - o.metrics.first_token_time)
               for o in outputs if not o.error and o.metrics.first_token_time and o.metrics.finished_time
               and len(o.outputs[0].token_ids) > 1]
    decode_time = sum(t for _, t in decoded)
    return {
        "model": model,
        "chat": use_chat,
        "num_requests": len(outputs),
        "num_failed": sum(1 for o in outputs if o.error),
        "output_tokens": output_tokens,
        "elapsed_s": round(elapsed, 4),
        "output_tokens_per_s": round(output_tokens / elapsed, 2) if elapsed > 0 else 0.0,
        "decode_tokens_per_s_per_request": round(sum(n for n, _ in decoded) / decode_time, 2) if decode_time else None,
        "engine": asdict(engine.stats()),
    }
