"""`llmopt eval` as one library call: `evaluate(args)` runs the built-in tasks and gates
(`run.run_eval`) and lm-evaluation-harness's own tasks (`lm-eval:TASK`), joins them into one
document in lm-eval's schema and writes it (and the per-sample files) where asked."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmopt.errors import LlmoptError
from llmopt.eval.args import EvalArgs

LM_EVAL_KEYS = ("results", "groups", "configs", "versions", "n-shot", "higher_is_better", "n-samples")


@dataclass
class Evaluation:
    document: dict[str, Any]  # lm-eval's schema; llmopt's table, gates and verdicts under "llmopt"
    lm_eval_document: dict[str, Any] | None  # lm-eval's tasks alone, when any ran
    exit_code: int  # 0 = no gate failed significantly, 1 = one did (--strict: or was inconclusive)
    built_in: bool  # the built-in tasks ran (the table and gate lines apply)


def evaluate(args: EvalArgs, recipe_layer: dict[str, Any] | None = None, output: Path | None = None,
             log_samples: bool = False) -> Evaluation:
    """Score `args.model` (and its baseline); LlmoptError (exit 2) for bad input, before any model runs.
    `recipe_layer`: a recipe's eval settings (`llmopt.recipes.loader.eval_settings`)."""
    from llmopt.eval.report.document import build_document, write_json
    from llmopt.eval.report.samples import write_samples
    from llmopt.eval.run import run_eval

    if log_samples and output is None:
        raise LlmoptError("--log-samples writes its JSONL beside the report: give --output FILE too")
    args.check()
    lm_tasks = args.lm_eval_tasks()
    if lm_tasks and not args.built_in_tasks():  # lm-eval's tasks alone: no built-in task, no gates
        doc = run_lm_eval_tasks(args, output, log_samples)
        return Evaluation(doc, doc, 0, built_in=False)
    report = run_eval(args.eval_request(recipe_layer))
    doc = build_document(report)
    lm_doc = None
    if lm_tasks:  # after the built-in tasks, so that a bad gate or data file fails before lm-eval's long run
        lm_doc = run_lm_eval_tasks(args, None, log_samples and output is not None, samples_dir=output)
        for key in LM_EVAL_KEYS:
            doc.setdefault(key, {}).update(lm_doc.get(key, {}))
        doc["llmopt"]["samples_files"] = dict(lm_doc["llmopt"].get("samples_files", {}))
    if output is not None:
        if log_samples:
            doc["llmopt"]["samples_files"] = {**write_samples(report, output),
                                              **doc["llmopt"].get("samples_files", {})}
        write_json(doc, output)
    return Evaluation(doc, lm_doc, report.exit_code, built_in=True)


def run_lm_eval_tasks(args: EvalArgs, output: Path | None, log_samples: bool,
                      samples_dir: Path | None = None) -> dict[str, Any]:
    """lm-eval's tasks on MODEL; the document in lm-eval's schema (written to `output` when given), and its
    samples as lm-eval's per-task JSONL files beside the report (`samples_<task>.jsonl`)."""
    from llmopt.eval.metrics.lm_eval_adapter import evaluate_tasks
    from llmopt.eval.report.document import write_json
    from llmopt.eval.report.samples import samples_path
    from llmopt.loader import load

    loaded = load(args.model, dtype=args.engine.dtype, device=args.engine.device)
    out = evaluate_tasks(loaded, args.lm_eval_tasks(),
                         include_path=str(args.lm_eval_include_path) if args.lm_eval_include_path else None,
                         num_fewshot=args.num_fewshot, limit=_lm_eval_limit(args.limit), add_bos=args.add_bos,
                         log_samples=log_samples)
    doc = {key: out[key] for key in LM_EVAL_KEYS if key in out}
    doc["llmopt"] = {"model": {"spec": args.model, "kind": loaded.source.kind, "path": str(loaded.source.path)}}
    target = output or samples_dir
    if log_samples and target is not None:
        from lm_eval.utils import handle_non_serializable

        from llmopt.core.atomic import atomic_file

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


def lm_eval_lines(doc: dict[str, Any]) -> list[str]:
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


def _lm_eval_limit(limit: str | None) -> int | float | None:
    if limit is None or limit.strip().lower() == "all":
        return None
    try:
        return float(limit) if "." in limit else int(limit)
    except ValueError:
        raise LlmoptError(f"--limit must be a number or 'all', got {limit!r}") from None
