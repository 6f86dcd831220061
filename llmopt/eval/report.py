"""The eval report: one JSON document close to lm-evaluation-harness's, a table, per-sample logs.

JSON (`build_document`), lm-eval's top-level sections with our metric names:
- `results`: the candidate's figures per task (`ppl`, `kld`, `mmlu` and `mmlu_<subject>`,
  `humaneval`), each metric with `<metric>_stderr` where one is defined;
  `baseline_results` the same for the baseline.
- `groups`: MMLU's aggregate and its four category groups (candidate; `baseline_groups`).
- `configs` (what each task ran on), `n-samples` (`original` items available,
  `effective` items scored), `versions`.
- `metrics`: the table's rows (baseline, candidate, change, 95% CI, gate, verdict);
  `gates`: every gate's full judgement; `passed` and `exit_code`.
- `timing` (seconds per model and task), `cache` (baseline cache hits), `model`, `baseline`.

Per-sample logs (`--log-samples`): one JSON line per scored item and task, both models side
by side, in `<output>.samples.jsonl` beside `--output`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.table import Table

from llmopt import __version__
from llmopt.core.atomic import atomic_file
from llmopt.eval import cache, stats
from llmopt.eval.gates import metric_info
from llmopt.eval.mmlu import LETTERS
from llmopt.eval.run import EvalReport, metric_samples, shown_metrics
from llmopt.eval.tasks import ModelRun

# Bumped when a task's scoring changes in a way that moves its numbers.
VERSIONS = {"ppl": 1, "kld": 1, "mmlu": 1, "humaneval": 1}


def _model_info(run: ModelRun) -> dict[str, Any]:
    q = run.source.quantization
    return {"spec": run.spec, "kind": run.source.kind, "path": str(run.source.path),
            "quantization": None if q is None else asdict(q)}


def _se(values) -> float | None:
    _, se = stats.mean_stderr(values)
    return None if math.isnan(se) else se


def task_results(run: ModelRun) -> tuple[dict[str, Any], dict[str, Any]]:
    """(results, groups) for one model."""
    results: dict[str, Any] = {}
    groups: dict[str, Any] = {}
    if run.text is not None:
        nll = run.text.nll
        results["ppl"] = {"ppl": run.text.ppl, "nll": float(nll.mean()), "nll_stderr": _se(nll),
                          "num_tokens": run.text.num_tokens}
        if run.text.kld is not None:
            k = run.text.kld
            results["kld"] = {**k.to_dict(), "mean_stderr": _se(k.per_position)}
    if run.mmlu is not None:
        m = run.mmlu
        results["mmlu"] = groups["mmlu"] = m.overall.to_dict()
        for name, score in m.groups.items():
            results[f"mmlu_{name}"] = groups[f"mmlu_{name}"] = score.to_dict()
        for name, score in m.subjects.items():
            results[f"mmlu_{name}"] = score.to_dict()
    if run.humaneval is not None:
        h = run.humaneval
        entry: dict[str, Any] = {}
        for k, value in h.pass_at_k.items():
            entry[f"pass@{k}"] = value
            entry[f"pass@{k}_stderr"] = _se(h.per_problem(k))
        entry.update(num_problems=len(h.problems), num_samples=len(h.samples), status_counts=h.status_counts())
        results["humaneval"] = entry
    return results, groups


def metric_rows(report: EvalReport) -> list[dict[str, Any]]:
    """The table: one row per shown or gated metric."""
    s = report.request.settings
    metrics = shown_metrics(s.tasks, s.pass_k)
    metrics += [g.metric for g in report.gates if g.metric not in metrics]
    rows = []
    for metric in metrics:
        smp = metric_samples(metric, report.candidate, report.baseline)
        gates = [g for g in report.gates if g.metric == metric]
        ci = report.intervals.get(metric)
        base = None if smp.baseline is None else smp.value(smp.baseline)
        cand = smp.value(smp.candidate)
        delta = None if base is None else (cand / base - 1 if metric == "ppl.ppl" else cand - base)
        row = {"metric": metric, "baseline": base, "candidate": cand, "delta": delta,
               "delta_kind": "relative" if metric == "ppl.ppl" else "change", "n": smp.n,
               "ci_low": ci.low if ci else None, "ci_high": ci.high if ci else None,
               "ci_of": "value" if base is None else "delta",
               "gate": ", ".join(g.bound for g in gates) or None,
               "verdict": "; ".join(g.note.split(":")[0] for g in gates) or None,
               "passed": all(g.passed for g in gates) if gates else None}
        if gates and gates[0].kind != "absolute":  # the gate's own CI is of its compared quantity
            row["ci_low"], row["ci_high"] = gates[0].ci_low, gates[0].ci_high
            row["delta"] = gates[0].delta
            row["delta_kind"] = gates[0].kind
        rows.append(row)
    return rows


def build_document(report: EvalReport) -> dict[str, Any]:
    s, data = report.request.settings, report.data
    cand, base = report.candidate, report.baseline
    results, groups = task_results(cand)
    doc: dict[str, Any] = {"model": _model_info(cand), "baseline": _model_info(base) if base else None,
                           "results": results, "groups": groups}
    if base is not None:
        doc["baseline_results"], doc["baseline_groups"] = task_results(base)
    configs: dict[str, Any] = {}
    n_samples: dict[str, Any] = {}
    if data.text is not None:
        text_cfg = {"text": data.text.source, "description": data.text.description, "context": s.ppl_context,
                    "stride": s.ppl_stride, "max_tokens_scored": s.max_tokens_scored,
                    "tokens": len(data.ids), "scored_tokens": cand.text.num_tokens}
        for task in ("ppl", "kld"):
            if task in s.tasks:
                configs[task] = dict(text_cfg)
                n_samples[task] = {"original": (data.text.num_tokens or len(data.ids)) - 1,
                                   "effective": cand.text.num_tokens}
        if "kld" in configs:
            configs["kld"]["baseline_rows"] = "float16 log-softmax, both sides rounded alike (see eval/textscore.py)"
    if data.mmlu is not None:
        configs["mmlu"] = {"source": s.mmlu_path or "bundled subset (llmopt/eval/data, MIT)", "num_fewshot": s.num_fewshot,
                           "limit_per_subject": s.mmlu_limit, "prompt": "lm-eval mmlu (0.4): description, question, "
                           "A-D choices, 'Answer:'; log-likelihood of ' A'..' D'"}
        n_samples["mmlu"] = {"original": data.mmlu_total, "effective": len(data.mmlu)}
    if data.problems is not None:
        configs["humaneval"] = {"mode": s.humaneval_mode, "samples": s.humaneval_samples,
                                "temperature": s.temperature if s.humaneval_samples > 1 else 0.0,
                                "top_p": s.top_p if s.humaneval_samples > 1 else 1.0, "seed": s.seed,
                                "max_tokens": s.humaneval_max_tokens, "pass_k": s.pass_k, "timeout_s": s.timeout}
        n_samples["humaneval"] = {"original": data.problems_total, "effective": len(data.problems)}
    doc.update({
        "configs": configs,
        "n-samples": n_samples,
        "versions": {**{t: VERSIONS[t] for t in s.tasks}, "llmopt": __version__},
        "metrics": metric_rows(report),
        "gates": [asdict(g) for g in report.gates],
        "skipped_gates": report.skipped_gates,
        "gates_source": s.gates_source if report.gates else None,
        "passed": report.exit_code == 0,
        "exit_code": report.exit_code,
        "timing": {"total_s": round(report.seconds, 2), "candidate": cand.seconds,
                   **({"baseline": base.seconds} if base else {})},
        "cache": {"dir": str(cache.cache_dir()), "baseline": base.cache if base else {}},
    })
    return doc


# ---------------------------------------------------------------------------- table


def _fmt_value(metric: str, x: float | None) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.2f}%" if metric_info(metric).percent else f"{x:.4g}"


def _fmt_delta(metric: str, kind: str, x: float | None) -> str:
    if x is None:
        return "-"
    if kind == "relative":
        return f"{100 * x:+.2f}%"
    return f"{100 * x:+.2f} pts" if metric_info(metric).percent else f"{x:+.4g}"


def render_table(doc: dict[str, Any]) -> Table:
    title = f"llmopt eval: {doc['model']['spec']}" + (f" vs baseline {doc['baseline']['spec']}" if doc["baseline"] else "")
    table = Table(title=title)
    for col in ("metric", "baseline", "candidate", "Δ", "95% CI", "gate", "verdict"):
        table.add_column(col, justify="right" if col in ("baseline", "candidate", "Δ") else "left", no_wrap=col == "metric")
    for row in doc["metrics"]:
        metric, kind = row["metric"], row["delta_kind"]
        if row["ci_low"] is None:
            ci = "-"
        elif row["ci_of"] == "value":
            ci = f"[{_fmt_value(metric, row['ci_low'])}, {_fmt_value(metric, row['ci_high'])}]"
        else:
            ci = f"[{_fmt_delta(metric, kind, row['ci_low'])}, {_fmt_delta(metric, kind, row['ci_high'])}]"
        verdict = row["verdict"] or ""
        style = "" if row["passed"] is None else ("green" if row["passed"] else "bold red")
        gate = ", ".join(b.partition(":")[2] for b in (row["gate"] or "").split(", ") if b)
        table.add_row(metric.replace(".ppl", "").replace(".acc", ""), _fmt_value(metric, row["baseline"]),
                      _fmt_value(metric, row["candidate"]), _fmt_delta(metric, kind, row["delta"]), ci, gate,
                      f"[{style}]{verdict}[/{style}]" if style else verdict)
    return table


def summary_lines(doc: dict[str, Any]) -> list[str]:
    lines = [f"gate {g['bound']}: {g['note']}" for g in doc["gates"]]
    for text in doc["skipped_gates"]:
        lines.append(f"gate {text}: skipped (task not run)")
    hits = [t for t, v in doc["cache"]["baseline"].items() if v == "hit"]
    timing = doc["timing"]
    parts = [f"total {timing['total_s']:.1f} s"]
    for role in ("baseline", "candidate"):
        if role in timing and timing[role]:
            parts.append(f"{role} " + ", ".join(f"{k} {v:.1f} s" for k, v in timing[role].items()))
    lines.append("time: " + "; ".join(parts) + (f" (baseline cache hits: {', '.join(hits)})" if hits else ""))
    if doc["gates"]:
        failed = [g["bound"] for g in doc["gates"] if not g["passed"]]
        lines.append(f"FAILED: {', '.join(failed)}" if failed else "all gates passed")
    return lines


# ---------------------------------------------------------------------------- files


def write_json(doc: dict[str, Any], path: Path) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n", encoding="utf-8")


def samples_path(output: Path) -> Path:
    output = Path(output)
    stem = output.name[: -len(".json")] if output.name.endswith(".json") else output.name
    return output.with_name(stem + ".samples.jsonl")


def write_samples(report: EvalReport, path: Path) -> int:
    """One line per item and task; returns the number of lines."""
    lines = []
    cand, base, data = report.candidate, report.baseline, report.data
    if cand.text is not None:
        ids = data.ids.tolist()
        first = len(ids) - cand.text.num_tokens
        k = cand.text.kld
        for i in range(cand.text.num_tokens):
            rec = {"task": "ppl+kld" if k else "ppl", "position": first + i, "token_id": ids[first + i],
                   "nll": float(cand.text.nll[i])}
            if base is not None:
                rec["nll_baseline"] = float(base.text.nll[i])
            if k is not None:
                rec.update(kld=k.per_position[i], same_top=k.same_top[i])
            lines.append(rec)
    if cand.mmlu is not None:
        for i, q in enumerate(data.mmlu):
            rec = {"task": "mmlu", "doc_id": i, "subject": q.subject, "question": q.question, "target": LETTERS[q.answer],
                   "candidate": _mmlu_sample(cand, i)}
            if base is not None:
                rec["baseline"] = _mmlu_sample(base, i)
            lines.append(rec)
    if cand.humaneval is not None:
        for i, p in enumerate(data.problems):
            rec = {"task": "humaneval", "doc_id": i, "task_id": p.task_id, "candidate": _he_sample(cand, i)}
            if base is not None:
                rec["baseline"] = _he_sample(base, i)
            lines.append(rec)
    with atomic_file(path) as tmp:
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in lines), encoding="utf-8")
    return len(lines)


def _mmlu_sample(run: ModelRun, i: int) -> dict[str, Any]:
    return {"loglikelihoods": run.mmlu_loglikelihoods[i], "predicted": LETTERS[run.mmlu.predicted[i]],
            "correct": run.mmlu.correct[i]}


def _he_sample(run: ModelRun, i: int) -> dict[str, Any]:
    p = run.humaneval.problems[i]
    return {"pass@1": p.pass_at(1), "samples": [
        {"completion": text, "status": sm.status, "detail": sm.detail}
        for text, sm in zip(run.completions[p.task_id], p.samples)]}
