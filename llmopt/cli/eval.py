"""`llmopt eval`: perplexity, KL divergence, MMLU and HumanEval, with quality gates that decide CI.

Exit codes: 0 = no gate failed significantly (inconclusive ones are reported; `--strict`
makes them fail too), 1 = a gate failed (its whole 95% CI beyond the bound), 2 = bad input.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

import typer

from llmopt.cli.common import (
    EXIT_GATE_FAILED,
    console,
    err_console,
    handles_errors,
    print_json,
)
from llmopt.cli.engine_args import EngineArgs, engine_options
from llmopt.errors import LlmoptError


@handles_errors
@engine_options()
def eval_command(
    model: str | None = typer.Argument(None, help="The candidate: 'default', a model folder, a .gguf file or a hub id. "
                                       "With --base-url: the model the endpoint serves, for its tokenizer only "
                                       "(default: the baseline's)."),
    baseline: str | None = typer.Option(None, "--baseline", "-b", help="The reference model (e.g. the unquantized one)."),
    tasks: str | None = typer.Option(None, "--tasks", "-t", help="Comma-separated: ppl, kld, mmlu, humaneval "
                                     "(default: ppl,kld,mmlu; kld only with --baseline), and lm-eval's own tasks as "
                                     "lm-eval:TASK (e.g. lm-eval:hellaswag,lm-eval:arc_easy; needs the lm-eval extra), "
                                     "run on MODEL."),
    lm_eval_include_path: Path | None = typer.Option(None, "--lm-eval-include-path", help="A folder of lm-eval task "
                                                      "YAMLs for lm-eval:TASK (local data, private tasks)."),
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
    base_url: str | None = typer.Option(None, "--base-url", help="Evaluate the model served at this OpenAI-compatible "
                                        "URL (llmopt serve, vLLM, ...) instead of a local one: ppl, kld and mmlu through "
                                        "/v1/completions with echo + logprobs, after a probe of its prompt logprobs."),
    api_key: str | None = typer.Option(None, "--api-key", help="--base-url's bearer key (default: $OPENAI_API_KEY, "
                                       "else $LLMOPT_API_KEY)."),
    served_model_name: str | None = typer.Option(None, "--served-model-name", help="--base-url: the model name to "
                                                 "send (default: the first id /v1/models lists)."),
    top_logprobs: int = typer.Option(20, "--top-logprobs", min=1, help="--base-url kld: alternatives per position "
                                     "(KLD over the top-k + a tail bucket, a lower bound of the full KLD)."),
    num_concurrent: int = typer.Option(4, "--num-concurrent", min=1, help="--base-url: requests in flight."),
    add_bos: bool | None = typer.Option(None, "--add-bos/--no-add-bos", help="MMLU: BOS before every context "
                                        "(default: where the tokenizer adds one, as lm-eval)."),
    use_cache: bool = typer.Option(True, "--cache/--no-cache", help="Reuse and store baseline results under "
                                   "$LLMOPT_CACHE/eval."),
    engine_args: EngineArgs = EngineArgs(),
) -> None:
    """Score MODEL (and --baseline) on ppl/kld/mmlu/humaneval and judge quality gates: exit 1 if one fails
    significantly (with --strict, also if one is inconclusive)."""
    from llmopt.eval.recipe import recipe_settings, resolve_settings
    from llmopt.eval.report.document import build_document, write_json
    from llmopt.eval.report.samples import write_samples
    from llmopt.eval.report.table import kld_summary_lines, render_table, summary_lines
    from llmopt.eval.run import EvalRequest, run_eval
    from llmopt.eval.tasks import RunOptions

    if log_samples and output is None:
        raise LlmoptError("--log-samples writes its JSONL beside the report: give --output FILE too")
    tasks, lm_tasks = _split_tasks(tasks)
    if lm_tasks and base_url is not None:
        raise LlmoptError("lm-eval:TASK runs on a local MODEL; for an endpoint run lm-eval's local-completions model "
                          "against it once `llmopt eval --base-url` has probed it")
    if lm_eval_include_path is not None and not lm_eval_include_path.is_dir():
        raise LlmoptError(f"--lm-eval-include-path {lm_eval_include_path} is not a folder")
    if lm_tasks and model is None:
        raise LlmoptError("lm-eval:TASK needs MODEL")
    if lm_tasks:
        try:
            import lm_eval  # noqa: F401
        except ImportError:
            raise LlmoptError("lm-eval:TASK needs lm-evaluation-harness: pip install 'llmopt[lm-eval]'") from None
        if not tasks:  # lm-eval's tasks alone: no built-in task, no gates
            doc = _run_lm_eval(model, lm_tasks, lm_eval_include_path, num_fewshot, limit, add_bos,
                               engine_args.dtype, engine_args.device, output, log_samples)
            screen = err_console if json_output else console
            for line in _lm_eval_lines(doc):
                screen.print(line, highlight=False, markup=False)
            if json_output:
                print_json(doc)
            return
    flags = {"tasks": tasks, "limit": limit, "gates": gate, "text": text, "ctx_size": ctx_size,
             "chunks": _chunks(chunks), "bootstrap_samples": bootstrap_samples,
             "strict": strict, "mmlu_path": mmlu_path,
             "num_fewshot": num_fewshot, "humaneval_mode": humaneval_mode, "humaneval_samples": humaneval_samples,
             "temperature": temperature, "seed": seed, "pass_k": pass_k, "humaneval_max_tokens": humaneval_max_tokens,
             "timeout": timeout}
    settings = resolve_settings(flags, recipe_settings(recipe) if recipe else None, has_baseline=baseline is not None)
    engine = engine_args.engine_config()
    options = RunOptions(dtype=engine_args.dtype, device=engine_args.device, engine=asdict(engine),
                         use_cache=use_cache, add_bos=add_bos)
    endpoint = None
    if base_url is not None:
        from llmopt.eval.endpoint import EndpointConfig
        from llmopt.openai_http import base_url as normalise_url

        endpoint = EndpointConfig(url=normalise_url(base_url, "--base-url"),
                                  api_key=api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("LLMOPT_API_KEY"),
                                  served_model_name=served_model_name, top_logprobs=top_logprobs,
                                  num_concurrent=num_concurrent)
    report = run_eval(EvalRequest(model=model, baseline=baseline, settings=settings, options=options, endpoint=endpoint))

    doc = build_document(report)
    lm_doc = None
    if lm_tasks:  # after the built-in tasks, so that a bad gate or data file fails before lm-eval's long run
        lm_doc = _run_lm_eval(model, lm_tasks, lm_eval_include_path, num_fewshot, limit, add_bos,
                              engine_args.dtype, engine_args.device, None, log_samples and output is not None,
                              samples_dir=output)
        for key in ("results", "groups", "configs", "versions", "n-shot", "higher_is_better", "n-samples"):
            doc.setdefault(key, {}).update(lm_doc.get(key, {}))
        doc["llmopt"]["samples_files"] = dict(lm_doc["llmopt"].get("samples_files", {}))
    if output is not None:
        if log_samples:
            doc["llmopt"]["samples_files"] = {**write_samples(report, output),
                                              **doc["llmopt"].get("samples_files", {})}
        write_json(doc, output)
    screen = err_console if json_output else console
    screen.print(render_table(doc))
    for line in kld_summary_lines(doc):
        screen.print(line, highlight=False, markup=False)
    for line in _lm_eval_lines(lm_doc or {}):
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


LM_EVAL_PREFIX = "lm-eval:"


def _split_tasks(value: str | None) -> tuple[str | None, list[str]]:
    """(built-in tasks, lm-eval task names) of --tasks."""
    if value is None:
        return None, []
    names = [t.strip() for t in value.split(",") if t.strip()]
    lm = [t[len(LM_EVAL_PREFIX):] for t in names if t.startswith(LM_EVAL_PREFIX)]
    if any(not t for t in lm):
        raise LlmoptError("--tasks lm-eval:TASK needs a task name after 'lm-eval:'")
    built_in = [t for t in names if not t.startswith(LM_EVAL_PREFIX)]
    return (",".join(built_in) if built_in else (None if not lm else "")), lm


def _lm_eval_limit(limit: str | None) -> int | float | None:
    if limit is None or limit.strip().lower() == "all":
        return None
    try:
        return float(limit) if "." in limit else int(limit)
    except ValueError:
        raise LlmoptError(f"--limit must be a number or 'all', got {limit!r}") from None


def _run_lm_eval(model: str, tasks: list[str], include_path: Path | None, num_fewshot: int | None, limit: str | None,
                 add_bos: bool | None, dtype: str, device: str, output: Path | None, log_samples: bool,
                 samples_dir: Path | None = None) -> dict:
    """lm-eval's tasks on MODEL; the document in lm-eval's schema (written to `output` when given), and its
    samples as lm-eval's per-task JSONL files beside the report (`samples_<task>.jsonl`)."""
    import json

    from llmopt.core import load
    from llmopt.eval.metrics.lm_eval_adapter import evaluate_tasks
    from llmopt.eval.report.document import write_json
    from llmopt.eval.report.samples import samples_path

    loaded = load(model, dtype=dtype, device=device)
    out = evaluate_tasks(loaded, tasks, include_path=str(include_path) if include_path else None,
                         num_fewshot=num_fewshot, limit=_lm_eval_limit(limit), add_bos=add_bos,
                         log_samples=log_samples)
    doc = {key: out[key] for key in ("results", "groups", "configs", "versions", "n-shot", "higher_is_better",
                                     "n-samples") if key in out}
    doc["llmopt"] = {"model": {"spec": model, "kind": loaded.source.kind, "path": str(loaded.source.path)}}
    target = output or samples_dir
    if log_samples and target is not None:
        from llmopt.core.atomic import atomic_file
        from lm_eval.utils import handle_non_serializable

        files = {}
        for task, samples in out.get("samples", {}).items():
            path = samples_path(Path(target), task)
            with atomic_file(path) as tmp:
                tmp.write_text("".join(json.dumps(s, default=handle_non_serializable, ensure_ascii=False) + "\n"
                                       for s in samples), encoding="utf-8")
            files[task] = str(path)
        doc["llmopt"]["samples_files"] = files
    if output is not None:
        write_json(json.loads(json.dumps(doc, default=str)), output)
    return doc


def _lm_eval_lines(doc: dict) -> list[str]:
    """One line per lm-eval task: its metrics (lm-eval's "<metric>,<filter>" keys) with their stderr."""
    lines = []
    for task, metrics in doc.get("results", {}).items():
        shown = []
        for key, value in metrics.items():
            name, _, filter_name = key.partition(",")
            if not filter_name or name.endswith("_stderr") or not isinstance(value, float):
                continue
            stderr = metrics.get(f"{name}_stderr,{filter_name}")
            shown.append(f"{name} {value:.4f}" + (f" ± {stderr:.4f}" if isinstance(stderr, float) else ""))
        if shown:
            lines.append(f"lm-eval {task}: " + ", ".join(shown))
    return lines
