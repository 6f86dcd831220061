"""`llmopt eval`: perplexity, KL divergence, MMLU and HumanEval, with quality gates that decide CI.

Exit codes: 0 = no gate failed significantly (inconclusive ones are reported; `--strict`
makes them fail too), 1 = a gate failed (its whole 95% CI beyond the bound), 2 = bad input.
"""

from __future__ import annotations

from pathlib import Path

import typer

from llmopt.cli.common import EXIT_GATE_FAILED, console, err_console, handles_errors, print_json
from llmopt.cli.options import request_options
from llmopt.errors import LlmoptError
from llmopt.eval.args import EvalArgs


@handles_errors
@request_options(EvalArgs, param="args")
def eval_command(
    args: EvalArgs,
    output: Path | None = typer.Option(None, "--output", "-o", help="Write the JSON report here (atomically)."),
    json_output: bool = typer.Option(False, "--json", help="Print the JSON report on stdout (the table goes to stderr)."),
    log_samples: bool = typer.Option(False, "--log-samples", help="Per-sample JSONL beside --output."),
) -> None:
    """Score MODEL (and --baseline) on ppl/kld/mmlu/humaneval and judge quality gates: exit 1 if one fails
    significantly (with --strict, also if one is inconclusive)."""
    from llmopt.eval.report.document import build_document, write_json
    from llmopt.eval.report.samples import write_samples
    from llmopt.eval.report.table import kld_summary_lines, render_table, summary_lines
    from llmopt.eval.run import run_eval

    if log_samples and output is None:
        raise LlmoptError("--log-samples writes its JSONL beside the report: give --output FILE too")
    args.check()
    lm_tasks = args.lm_eval_tasks()
    screen = err_console if json_output else console
    if lm_tasks and not args.built_in_tasks():  # lm-eval's tasks alone: no built-in task, no gates
        doc = _run_lm_eval(args, output, log_samples)
        for line in _lm_eval_lines(doc):
            screen.print(line, highlight=False, markup=False)
        if json_output:
            print_json(doc)
        return
    recipe_layer = None
    if args.recipe is not None:
        from llmopt.recipes.loader import recipe_eval_settings

        recipe_layer = recipe_eval_settings(args.recipe)
    report = run_eval(args.eval_request(recipe_layer))
    doc = build_document(report)
    lm_doc = None
    if lm_tasks:  # after the built-in tasks, so that a bad gate or data file fails before lm-eval's long run
        lm_doc = _run_lm_eval(args, None, log_samples and output is not None, samples_dir=output)
        for key in ("results", "groups", "configs", "versions", "n-shot", "higher_is_better", "n-samples"):
            doc.setdefault(key, {}).update(lm_doc.get(key, {}))
        doc["llmopt"]["samples_files"] = dict(lm_doc["llmopt"].get("samples_files", {}))
    if output is not None:
        if log_samples:
            doc["llmopt"]["samples_files"] = {**write_samples(report, output),
                                              **doc["llmopt"].get("samples_files", {})}
        write_json(doc, output)
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


def _lm_eval_limit(limit: str | None) -> int | float | None:
    if limit is None or limit.strip().lower() == "all":
        return None
    try:
        return float(limit) if "." in limit else int(limit)
    except ValueError:
        raise LlmoptError(f"--limit must be a number or 'all', got {limit!r}") from None


def _run_lm_eval(args: EvalArgs, output: Path | None, log_samples: bool, samples_dir: Path | None = None) -> dict:
    """lm-eval's tasks on MODEL; the document in lm-eval's schema (written to `output` when given), and its
    samples as lm-eval's per-task JSONL files beside the report (`samples_<task>.jsonl`)."""
    import json

    from llmopt.eval.metrics.lm_eval_adapter import evaluate_tasks
    from llmopt.eval.report.document import write_json
    from llmopt.eval.report.samples import samples_path
    from llmopt.loader import load

    model = args.model
    loaded = load(model, dtype=args.engine.dtype, device=args.engine.device)
    out = evaluate_tasks(loaded, args.lm_eval_tasks(),
                         include_path=str(args.lm_eval_include_path) if args.lm_eval_include_path else None,
                         num_fewshot=args.num_fewshot, limit=_lm_eval_limit(args.limit), add_bos=args.add_bos,
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
