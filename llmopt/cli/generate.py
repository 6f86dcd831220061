"""`llmopt generate`: offline generation for one prompt or a file of them, on the paged runtime."""

from __future__ import annotations

import typer

from llmopt.cli.common import err_console, handles_errors, print_json
from llmopt.cli.options import request_options
from llmopt.runtime.generate import GenerateArgs


@handles_errors
@request_options(GenerateArgs, param="args")
def generate(
    args: GenerateArgs,
    json_output: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """Generate completions for one or many prompts, continuously batched."""
    from llmopt.runtime.generate import run_generate

    result = run_generate(args)
    records, summary = result.records, result.summary
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
            f"[dim]{summary['num_requests']} request(s), {summary['output_tokens']} tokens in "
            f"{summary['elapsed_s']:.2f} s = {summary['output_tokens_per_s']} tok/s, mean TTFT {mean_ttft:.0f} ms"
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
    for i, error in result.failed:
        typer.echo(f"error: prompt {i}: {error}", err=True)
    if result.failed:
        raise typer.Exit(2)
