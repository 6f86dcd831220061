"""The eval report's per-sample logs (`--log-samples`, `write_samples`): lm-eval's per-task JSONL files beside
`--output` (`<stem>.samples_<task>.jsonl`, MMLU per subject), the baseline's response for the
same item under `llmopt_baseline`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from llmopt.core.atomic import atomic_file
from llmopt.eval.metrics.windows import plan_chunks
from llmopt.eval.run import EvalReport
from llmopt.eval.tasks import ModelRun


def samples_path(output: Path, task: str) -> Path:
    """`<output stem>.samples_<task>.jsonl` beside the report (lm-eval names its files samples_<task>_<date>.jsonl)."""
    output = Path(output)
    stem = output.name[: -len(".json")] if output.name.endswith(".json") else output.name
    return output.with_name(f"{stem}.samples_{task}.jsonl")


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _lm_eval_sample(doc_id: int, doc: dict[str, Any], target: str, arguments: list[tuple], resps: list[list],
                    metrics: dict[str, Any]) -> dict[str, Any]:
    """One line as lm-eval's EvaluationTracker saves it: arguments as gen_args_i/arg_j, responses as strings."""
    def strings(x):
        return [strings(v) for v in x] if isinstance(x, (list, tuple)) else str(x)

    return {"doc_id": doc_id, "doc": doc, "target": target,
            "arguments": {f"gen_args_{i}": {f"arg_{j}": a for j, a in enumerate(args)}
                          for i, args in enumerate(arguments)},
            "resps": strings([[r] for r in resps]), "filtered_resps": strings(resps), "filter": "none",
            "metrics": list(metrics), "doc_hash": _hash(json.dumps(doc, indent=2, ensure_ascii=False)),
            "prompt_hash": _hash(str(arguments[0][0])) if arguments else _hash(""), "target_hash": _hash(target),
            **metrics}


def write_samples(report: EvalReport, output: Path) -> dict[str, str]:
    """Per task, one JSONL file of the candidate's samples in lm-eval's format (MMLU per subject, as lm-eval's
    mmlu_<subject> tasks; ppl/kld one line per scored token, which lm-eval has no task for); the baseline's
    response for the same item, where there is one, under "llmopt_baseline". Returns {task: path}."""
    by_task: dict[str, list[dict[str, Any]]] = {}
    cand, base, data, s = report.candidate, report.baseline, report.data, report.request.settings
    if cand.text is not None:
        name = "kld" if cand.text.kld is not None else "ppl"
        ids = data.ids.tolist()
        chunks = plan_chunks(len(ids), s.ctx_size)
        positions = [c * chunks.ctx_size + j for c in range(chunks.count) for j in range(chunks.first + 1, chunks.ctx_size)]
        k = cand.text.kld
        for i, position in enumerate(positions):
            metrics: dict[str, Any] = {"nll": float(cand.text.nll[i])}
            if k is not None:
                metrics.update(kld=float(k.per_position[i]), same_top=int(k.same_top[i]), delta_p=float(k.delta_p_values[i]))
            line = {"doc_id": i, "doc": {"position": position, "token_id": ids[position]}, "target": str(ids[position]),
                    "filter": "none", "metrics": list(metrics), **metrics}
            if base is not None:
                line["llmopt_baseline"] = {"nll": float(base.text.nll[i])}
            by_task.setdefault(name, []).append(line)
    if cand.mmlu is not None:
        from llmopt.eval.metrics.mmlu import build_requests

        requests = build_requests(data.mmlu, s.num_fewshot, data.mmlu_dev)
        seen: dict[str, int] = {}
        for i, (q, request) in enumerate(zip(data.mmlu, requests)):
            doc_id = seen[q.subject] = seen.get(q.subject, -1) + 1
            doc = {"question": q.question, "subject": q.subject, "choices": list(q.choices), "answer": q.answer}
            arguments = [(request.context, c) for c in request.continuations]
            resps = [[ll, None] for ll in cand.mmlu_loglikelihoods[i]]  # is_greedy: not computed by llmopt
            line = _lm_eval_sample(doc_id, doc, str(q.answer), arguments, resps, {"acc": float(cand.mmlu.correct[i])})
            if base is not None:
                line["llmopt_baseline"] = {"loglikelihoods": base.mmlu_loglikelihoods[i], "acc": base.mmlu.correct[i]}
            by_task.setdefault(f"mmlu_{q.subject}", []).append(line)
    if cand.humaneval is not None:
        for i, p in enumerate(data.problems):
            result = cand.humaneval.problems[i]
            texts = cand.completions[p.task_id]
            line = _lm_eval_sample(i, {"task_id": p.task_id, "prompt": p.prompt}, p.task_id, [(p.prompt,)], texts,
                                   {"pass@1": result.pass_at(1)})
            line["llmopt_status"] = [{"status": sm.status, "detail": sm.detail} for sm in result.samples]
            if base is not None:
                line["llmopt_baseline"] = _he_sample(base, i)
            by_task.setdefault("humaneval", []).append(line)
    paths = {}
    for task, lines in by_task.items():
        path = samples_path(output, task)
        with atomic_file(path) as tmp:
            tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in lines), encoding="utf-8")
        paths[task] = str(path)
    return paths


def _he_sample(run: ModelRun, i: int) -> dict[str, Any]:
    p = run.humaneval.problems[i]
    return {"pass@1": p.pass_at(1), "samples": [
        {"completion": text, "status": sm.status, "detail": sm.detail}
        for text, sm in zip(run.completions[p.task_id], p.samples)]}
