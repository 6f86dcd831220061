"""`llmopt eval`: perplexity, KL divergence, MMLU and HumanEval, with quality gates that decide CI.

Exit codes: 0 = no gate failed significantly (inconclusive ones are reported; `--strict`
makes them fail too), 1 = a gate failed (its whole 95% CI beyond the bound), 2 = bad input.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import typer

from llmopt.cli.common import (
    BLOCK_SIZE,
    DEVICE,
    DTYPE,
    EXIT_GATE_FAILED,
    GPU_MEMORY_UTILIZATION,
    KV_CACHE_DTYPE,
    KV_CACHE_MEMORY,
    MAX_MODEL_LEN,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    PREFIX_CACHING,
    console,
    engine_config,
    err_console,
    handles_errors,
    print_json,
)
from llmopt.errors import LlmoptError


@handles_errors
def eval_command(
    model: str = typer.Argument(..., help="The candidate: 'default', a model folder, a .gguf file or a hub id."),
    baseline: str | None = typer.Option(None, "--baseline", "-b", help="The reference model (e.g. the unquantized one)."),
    tasks: str | None = typer.Option(None, "--tasks", "-t", help="Comma-separated: ppl, kld, mmlu, humaneval "
                                     "(default: ppl,kld,mmlu; kld only with --baseline)."),
    limit: str | None = typer.Option(None, "--limit", help="MMLU questions per subject and HumanEval problems: N, a "
                                     "fraction < 1, or 'all' (default: 5 per MMLU subject, all 164 problems)."),
    gate: str | None = typer.Option(None, "--gate", "-g", help="METRIC:BOUND,... e.g. mmlu.acc:-1.0,kld.mean:0.05,ppl:+5% "
                                    "('none': no gates) (default with --baseline: llmopt/recipes/default-gates.yaml)."),
    recipe: Path | None = typer.Option(None, "--recipe", help="A recipe (YAML): its eval section's tasks, gates and options (flags win)."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Write the JSON report here (atomically)."),
    json_output: bool = typer.Option(False, "--json", help="Print the JSON report on stdout (the table goes to stderr)."),
    log_samples: bool = typer.Option(False, "--log-samples", help="Per-sample JSONL beside --output."),
    text: str | None = typer.Option(None, "--text", help="ppl/kld text: 'bundled' (MMLU subset as text), a .txt/.jsonl "
                                    "file, or hf:NAME[:CONFIG][:SPLIT] e.g. hf:wikitext:wikitext-2-raw-v1."),
    ctx_size: int | None = typer.Option(None, "--ctx-size", "-c", help="ppl/kld chunk length, as llama.cpp's "
                                        "llama-perplexity: non-overlapping chunks, second half scored (default: 512)."),
    chunks: str | None = typer.Option(None, "--chunks", help="ppl/kld: at most this many chunks, or 'all' "
                                      "(default: 16, 4,080 scored tokens at --ctx-size 512)."),
    mmlu_path: str | None = typer.Option(None, "--mmlu-path", help="MMLU in the cais schema: a local file, or "
                                         "hf:cais/mmlu (default: the bundled subset)."),
    num_fewshot: int | None = typer.Option(None, "--num-fewshot", help="MMLU examples from the dev split (default: 0)."),
    humaneval_mode: str | None = typer.Option(None, "--humaneval-mode", help="completion or chat (default: completion)."),
    humaneval_samples: int | None = typer.Option(None, "--humaneval-samples", help="Samples per problem; 1 = greedy (default: 1)."),
    temperature: float | None = typer.Option(None, "--temperature", help="HumanEval sampling when samples > 1 (default: 0.8)."),
    seed: int | None = typer.Option(None, "--seed", help="Seed of the bootstrap; HumanEval sample i uses seed + i "
                                    "(default: 0)."),
    bootstrap_samples: int | None = typer.Option(None, "--bootstrap-samples", help="Bootstrap resamples per "
                                                 "confidence interval (default: 1000)."),
    strict: bool | None = typer.Option(None, "--strict/--no-strict", help="Exit 1 on inconclusive gates too (CI "
                                       "straddling the bound, or too few items); default: only significant failures."),
    pass_k: str | None = typer.Option(None, "--pass-k", help="k values for pass@k, e.g. 1,10 (default: 1)."),
    humaneval_max_tokens: int | None = typer.Option(None, "--humaneval-max-tokens", help="Tokens per completion (default: 384)."),
    timeout: float | None = typer.Option(None, "--timeout", help="Sandbox wall time per program, seconds (default: 5)."),
    use_cache: bool = typer.Option(True, "--cache/--no-cache", help="Reuse and store baseline results under "
                                   "$LLMOPT_CACHE/eval."),
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
    """Score MODEL (and --baseline) on ppl/kld/mmlu/humaneval and judge quality gates: exit 1 if one fails
    significantly (with --strict, also if one is inconclusive)."""
    from llmopt.eval.recipe import recipe_settings, resolve_settings
    from llmopt.eval.report import (
        build_document,
        kld_summary_lines,
        render_table,
        samples_path,
        summary_lines,
        write_json,
        write_samples,
    )
    from llmopt.eval.run import EvalRequest, run_eval
    from llmopt.eval.tasks import RunOptions

    if log_samples and output is None:
        raise LlmoptError("--log-samples writes its JSONL beside the report: give --output FILE too")
    flags = {"tasks": tasks, "limit": limit, "gates": gate, "text": text, "ctx_size": ctx_size,
             "chunks": _chunks(chunks), "bootstrap_samples": bootstrap_samples,
             "strict": strict, "mmlu_path": mmlu_path,
             "num_fewshot": num_fewshot, "humaneval_mode": humaneval_mode, "humaneval_samples": humaneval_samples,
             "temperature": temperature, "seed": seed, "pass_k": pass_k, "humaneval_max_tokens": humaneval_max_tokens,
             "timeout": timeout}
    settings = resolve_settings(flags, recipe_settings(recipe) if recipe else None, has_baseline=baseline is not None)
    engine = engine_config(max_num_seqs, max_num_batched_tokens, max_model_len, block_size, enable_prefix_caching,
                           kv_cache_memory, gpu_memory_utilization, kv_cache_dtype)
    options = RunOptions(dtype=dtype, device=device, engine=asdict(engine), use_cache=use_cache)
    report = run_eval(EvalRequest(model=model, baseline=baseline, settings=settings, options=options))

    doc = build_document(report)
    if output is not None:
        if log_samples:
            path = samples_path(output)
            write_samples(report, path)
            doc["samples_file"] = str(path)
        write_json(doc, output)
    screen = err_console if json_output else console
    screen.print(render_table(doc))
    for line in kld_summary_lines(doc):
        screen.print(line, highlight=False, markup=False)
    for line in summary_lines(doc):
        screen.print(line, highlight=False, markup=False)
    if json_output:
        print_json(doc)
    if report.exit_code:
        raise typer.Exit(EXIT_GATE_FAILED)


def _chunks(value: str | None) -> int | str | None:
    """--chunks N or 'all' (checked with the other settings)."""
    if value is None or value.strip().lower() == "all":
        return value and "all"
    try:
        return int(value)
    except ValueError:
        raise LlmoptError(f"--chunks must be a whole number or 'all', got {value!r}") from None
