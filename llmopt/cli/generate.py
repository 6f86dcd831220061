"""`llmopt generate`: one-shot offline generation."""

from __future__ import annotations

import typer

from llmopt.cli.common import err_console, handles_errors, print_json
from llmopt.errors import LlmoptError


@handles_errors
def generate(
    model: str = typer.Argument("default", help="'default', a model folder, a .gguf file or a hub id"),
    prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt (a user message for chat models)."),
    system: str | None = typer.Option(None, "--system", help="System message (chat models)."),
    chat: bool | None = typer.Option(None, "--chat/--no-chat", help="Apply the chat template (default: when the model has one)."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="Most tokens to generate."),
    temperature: float = typer.Option(0.8, "--temperature", "-t", help="0 = greedy."),
    top_p: float = typer.Option(0.95, "--top-p"),
    top_k: int = typer.Option(40, "--top-k", help="0 = off."),
    min_p: float = typer.Option(0.0, "--min-p"),
    seed: int | None = typer.Option(None, "--seed", help="Make sampling reproducible."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Keep going past end-of-sequence."),
    dtype: str = typer.Option("auto", "--dtype", help="auto, float32, bfloat16 or float16"),
    device: str = typer.Option("cpu", "--device"),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """Generate a completion for one prompt."""
    from llmopt.core import load
    from llmopt.runtime import SamplingParams
    from llmopt.runtime.generate import generate as run_generate

    if not prompt.strip():
        raise LlmoptError("--prompt is empty")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            min_p=min_p, seed=seed, ignore_eos=ignore_eos)
    loaded = load(model, dtype=dtype, device=device)
    tokenizer = loaded.tokenizer
    use_chat = tokenizer.is_chat if chat is None else chat
    if use_chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        prompt_ids = tokenizer.encode_chat(messages)
    else:
        if system:
            raise LlmoptError("--system needs the chat template; drop --no-chat")
        prompt_ids = tokenizer.encode(prompt)
    result = run_generate(loaded, prompt_ids, params)
    stats = {
        "num_prompt_tokens": len(result.prompt_token_ids),
        "num_generated_tokens": len(result.token_ids),
        "finish_reason": result.finish_reason,
        "time_to_first_token_s": round(result.time_to_first_token_s, 4),
        "elapsed_s": round(result.elapsed_s, 4),
        "tokens_per_s": round(result.tokens_per_s, 2),
    }
    if json_output:
        print_json({"model": model, "prompt": prompt, "chat": use_chat, "text": result.text,
                    "prompt_token_ids": result.prompt_token_ids, "token_ids": result.token_ids, **stats})
        return
    typer.echo(result.text)
    err_console.print(
        f"[dim]{stats['num_generated_tokens']} tokens, {stats['tokens_per_s']} tok/s, "
        f"first token {stats['time_to_first_token_s'] * 1000:.0f} ms, finish: {result.finish_reason}[/dim]"
    )
