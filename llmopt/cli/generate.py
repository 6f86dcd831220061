"""`llmopt generate`: offline generation for one prompt or a file of them, on the paged runtime."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from llmopt.cli.common import err_console, handles_errors, print_json
from llmopt.cli.engine_args import EngineArgs, engine_options
from llmopt.errors import LlmoptError

if TYPE_CHECKING:
    from llmopt.runtime import SamplingParams
    from llmopt.runtime.outputs import RequestOutput
    from llmopt.runtime.engine_protocol import ServingEngine


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


@handles_errors
@engine_options()
def generate(
    model: str = typer.Argument("default", help="'default', a model folder, a .gguf file or a hub id"),
    prompt: list[str] = typer.Option([], "--prompt", "-p", help="A prompt (a user message for chat models); repeatable."),
    prompts_file: Path | None = typer.Option(None, "--prompts-file", "-f", help=".txt (a prompt per line) or .jsonl ({\"prompt\"} or {\"messages\"})."),
    system: str | None = typer.Option(None, "--system", help="System message (chat models)."),
    chat: bool | None = typer.Option(None, "--chat/--no-chat", help="Apply the chat template (default: when the model has one)."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="Most tokens to generate per prompt."),
    temperature: float = typer.Option(0.8, "--temperature", "-t", help="0 = greedy."),
    top_p: float = typer.Option(0.95, "--top-p"),
    top_k: int = typer.Option(40, "--top-k", help="0 = off."),
    min_p: float = typer.Option(0.0, "--min-p"),
    seed: int | None = typer.Option(None, "--seed", help="Make sampling reproducible."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string; repeatable."),
    presence_penalty: float = typer.Option(0.0, "--presence-penalty"),
    frequency_penalty: float = typer.Option(0.0, "--frequency-penalty"),
    repetition_penalty: float = typer.Option(1.0, "--repetition-penalty"),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Keep going past end-of-sequence."),
    engine: str = typer.Option("llmopt", "--engine", help="llmopt (our paged runtime) or llama.cpp (a .gguf file through llama-cpp-python, one request at a time)."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON document."),
    engine_args: EngineArgs = EngineArgs(),
) -> None:
    """Generate completions for one or many prompts, continuously batched."""
    from llmopt.runtime import SamplingParams

    prompts: list[Any] = list(prompt) + (read_prompts_file(prompts_file) if prompts_file else [])
    if not prompts:
        raise LlmoptError("give a prompt with --prompt or a file with --prompts-file")
    if len(prompts) == 1 and isinstance(prompts[0], str) and not prompts[0].strip():
        raise LlmoptError("--prompt is empty")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                            seed=seed, stop=stop or None, presence_penalty=presence_penalty,
                            frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty,
                            ignore_eos=ignore_eos)
    config = engine_args.engine_config()  # bad flags are reported before any model loads
    if engine not in ("llmopt", "llama.cpp"):
        raise LlmoptError(f"unknown engine {engine!r}; choose llmopt or llama.cpp")
    if engine == "llama.cpp":
        from llmopt.runtime.llamacpp_engine import LlamaCppEngine

        if config.speculative_config is not None:
            raise LlmoptError("speculative decoding runs on --engine llmopt, not llama.cpp")
        llm_engine = LlamaCppEngine.from_spec(model, max_model_len=engine_args.max_model_len)
    else:
        from llmopt.core import load
        from llmopt.runtime.llm import LLM

        llm = LLM(load(model, dtype=engine_args.dtype, device=engine_args.device), engine_config=config)
        llm_engine = llm.engine
    tokenizer = llm_engine.tokenizer
    use_chat = tokenizer.is_chat if chat is None else chat
    if system and not use_chat:
        raise LlmoptError("--system needs the chat template; drop --no-chat")
    requests = [_as_request(p, use_chat, system) for p in prompts]
    start = time.perf_counter()
    outputs = _generate_llamacpp(llm_engine, requests, params) if engine == "llama.cpp" else llm.generate(requests, params)
    elapsed = time.perf_counter() - start

    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    failed = [(i, o) for i, o in enumerate(outputs) if o.error]
    records = [
        {
            "index": i,
            "prompt": p if isinstance(p, str) else p.get("messages"),
            "text": o.outputs[0].text,
            "finish_reason": o.outputs[0].finish_reason,
            "error": o.error,
            "num_prompt_tokens": len(o.prompt_token_ids),
            "num_cached_tokens": o.num_cached_tokens,
            "num_generated_tokens": len(o.outputs[0].token_ids),
            "prompt_token_ids": o.prompt_token_ids,
            "token_ids": o.outputs[0].token_ids,
            "metrics": o.metrics.to_dict(),
        }
        for i, (p, o) in enumerate(zip(prompts, outputs))
    ]
    # decode speed of a request: its tokens after the first over the time after the first (llama.cpp's
    # "eval" rate); pooled over requests, so with --max-num-seqs 1 it is batch-1 decode
    decoded = [(len(o.outputs[0].token_ids) - 1, o.metrics.finished_time - o.metrics.first_token_time)
               for o in outputs if not o.error and o.metrics.first_token_time and o.metrics.finished_time
               and len(o.outputs[0].token_ids) > 1]
    decode_time = sum(t for _, t in decoded)
    summary = {
        "model": model,
        "chat": use_chat,
        "num_requests": len(outputs),
        "num_failed": len(failed),
        "output_tokens": output_tokens,
        "elapsed_s": round(elapsed, 4),
        "output_tokens_per_s": round(output_tokens / elapsed, 2) if elapsed > 0 else 0.0,
        "decode_tokens_per_s_per_request": round(sum(n for n, _ in decoded) / decode_time, 2) if decode_time else None,
        "engine": asdict(llm_engine.stats()),
    }
    if json_output:
        print_json({**summary, "requests": records})
    else:
        for record in records:
            if record["error"]:
                continue
            if len(records) > 1:
                typer.echo(f"--- [{record['index']}] ({record['finish_reason']})")
            typer.echo(record["text"])
        ttfts = [r["metrics"]["time_to_first_token_s"] for r in records if r["metrics"]["time_to_first_token_s"]]
        mean_ttft = sum(ttfts) / len(ttfts) * 1000 if ttfts else 0.0
        err_console.print(
            f"[dim]{len(outputs)} request(s), {output_tokens} tokens in {elapsed:.2f} s = "
            f"{summary['output_tokens_per_s']} tok/s, mean TTFT {mean_ttft:.0f} ms"
            + (f", decode {summary['decode_tokens_per_s_per_request']} tok/s per request"
               if summary["decode_tokens_per_s_per_request"] else "") + "[/dim]"
        )
        spec = summary["engine"].get("spec_decode")
        if spec:
            err_console.print(
                f"[dim]speculative decoding: {spec['num_drafts']} proposals, {spec['num_accepted_tokens']} of "
                f"{spec['num_draft_tokens']} draft tokens accepted ({spec['acceptance_rate']:.1%}), "
                f"mean acceptance length {spec['mean_acceptance_length']:.2f} tokens per step[/dim]"
            )
    for i, out in failed:
        typer.echo(f"error: prompt {i}: {out.error}", err=True)
    if failed:
        raise typer.Exit(2)


def _generate_llamacpp(engine: ServingEngine, requests: list[Any], params: SamplingParams) -> list[RequestOutput]:
    """Final outputs of each request through the llama.cpp engine (it serves them in order)."""
    import asyncio

    async def run_all():
        async def final(prompt):
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


def _as_request(prompt: Any, use_chat: bool, system: str | None) -> Any:
    if isinstance(prompt, dict):  # chat messages from a .jsonl file
        return prompt
    if not use_chat:
        return prompt
    if not prompt.strip():
        return ""  # rejected by the engine as an empty prompt, for this request only
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return {"messages": messages}
