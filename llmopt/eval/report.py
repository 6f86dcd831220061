"""The eval report: one JSON document in lm-evaluation-harness's schema, a table, per-task sample logs.

JSON (`build_document`), lm-eval's top-level sections for the candidate:
- `results`: per task (`ppl`, `kld`, `mmlu` and `mmlu_<subject>`, `humaneval`) {"alias",
  "<metric>,none", "<metric>_stderr,none"} ("N/A" where a stderr is undefined); `kld` holds
  llama.cpp's whole KLD summary, Δp's statistics as `delta_p_<stat>`.
- `groups`: MMLU's aggregate and its four category groups, the same way.
- `configs` (what each task ran on), `versions`, `n-shot`, `higher_is_better`, `n-samples`
  (`original` items available, `effective` items scored; per MMLU subject too), `config`.
Under `llmopt`, what lm-eval has no place for: `model`/`baseline` (an endpoint: its URL, served
name and tokenizer), `results`/`baseline_results` in llmopt's own nested form (KLD's summary
as `kld.KLDResult.to_dict`), `baseline_lm_eval_results`; `metrics`, the table's rows (baseline,
candidate, change, 95% CI, gate, verdict); `gates`, every gate's full judgement (pass / fail /
inconclusive); `bootstrap`, `strict`, `passed`, `exit_code`; `timing`, `cache`;
`samples_files`.

Per-sample logs (`--log-samples`, `write_samples`): lm-eval's per-task JSONL files beside
`--output` (`<stem>.samples_<task>.jsonl`, MMLU per subject), the baseline's response for the
same item under `llmopt_baseline`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.table import Table

from llmopt import __version__
from llmopt.core.atomic import atomic_file
from llmopt.eval import cache, stats
from llmopt.eval.gates import ABSOLUTE, FAIL, INCONCLUSIVE, PASS, RELATIVE, display_kind, metric_info
from llmopt.eval.run import EvalReport, metric_samples, shown_metrics
from llmopt.eval.tasks import ModelRun
from llmopt.eval.windows import plan_chunks

# Bumped when a task's scoring changes in a way that moves its numbers.
VERSIONS = {"ppl": 1, "kld": 1, "mmlu": 1, "humaneval": 1}


def _model_info(run: ModelRun) -> dict[str, Any]:
    if run.endpoint is not None:  # a served model: what answered, and whose tokenizer its prompts were made with
        return {"spec": run.spec, "kind": "endpoint", **run.endpoint, "tokenizer": run.source.spec}
    q = run.source.quantization
    return {"spec": run.spec, "kind": run.source.kind, "path": str(run.source.path),
            "quantization": None if q is None else asdict(q)}


def task_results(run: ModelRun) -> tuple[dict[str, Any], dict[str, Any]]:
    """(results, groups) for one model."""
    results: dict[str, Any] = {}
    groups: dict[str, Any] = {}
    if run.text is not None:
        nll = run.text.nll
        se = stats.stderr(nll)
        # llama.cpp's "PPL = x +/- ppl * stderr(nll)"
        results["ppl"] = {"ppl": run.text.ppl, "ppl_stderr": None if se is None else run.text.ppl * se,
                          "nll": float(nll.mean()), "nll_stderr": se, "num_tokens": run.text.num_tokens}
        if run.text.kld is not None:
            results["kld"] = run.text.kld.to_dict()
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
            entry[f"pass@{k}_stderr"] = stats.stderr(h.per_problem(k))
        entry.update(num_problems=len(h.problems), num_samples=len(h.samples), status_counts=h.status_counts())
        results["humaneval"] = entry
    return results, groups


HIGHER_IS_BETTER = {"ppl": {"ppl": False, "nll": False}, "mmlu": {"acc": True}}


def lm_eval_results(run: ModelRun) -> tuple[dict[str, Any], dict[str, Any], dict[str, dict[str, bool]]]:
    """(results, groups, higher_is_better) in lm-eval's schema: per task {"alias", "<metric>,none",
    "<metric>_stderr,none"} ("N/A" where a stderr is undefined); KLD's whole llama.cpp summary flattened
    (delta_p's as delta_p_<stat>)."""
    def entry(alias: str, metrics: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"alias": alias}
        for name, value in metrics.items():
            out[f"{name},none"] = "N/A" if value is None and name.endswith("_stderr") else value
        return out

    detailed, _ = task_results(run)
    results: dict[str, Any] = {}
    groups: dict[str, Any] = {}
    better: dict[str, dict[str, bool]] = {}
    if "ppl" in detailed:
        p = detailed["ppl"]
        results["ppl"] = entry("ppl", {k: p[k] for k in ("ppl", "ppl_stderr", "nll", "nll_stderr")})
        better["ppl"] = dict(HIGHER_IS_BETTER["ppl"])
    if "kld" in detailed:
        k = dict(detailed["kld"])
        flat = {name: value for name, value in k.items() if name not in ("delta_p", "num_tokens")}
        flat.update({f"delta_p_{name}": value for name, value in k["delta_p"].items()})
        results["kld"] = entry("kld", flat)
        better["kld"] = {name: name.startswith("same_top_p") for name in flat if not name.endswith("_stderr")}
    if run.mmlu is not None:
        results.update(run.mmlu.lm_eval_results())
        groups = {name: results[name] for name in ("mmlu", *(f"mmlu_{g}" for g in run.mmlu.groups))}
        better.update({name: dict(HIGHER_IS_BETTER["mmlu"]) for name in results if name.startswith("mmlu")})
    if "humaneval" in detailed:
        h = detailed["humaneval"]
        results["humaneval"] = entry("humaneval", {k: v for k, v in h.items() if k.startswith("pass@")})
        better["humaneval"] = {k: True for k in h if k.startswith("pass@") and not k.endswith("_stderr")}
    return results, groups, better


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
        kind = display_kind(metric, smp)
        delta = None if base is None else (cand / base - 1 if kind == RELATIVE else cand - base)
        row = {"metric": metric, "baseline": base, "candidate": cand, "delta": delta,
               "delta_kind": kind, "n": smp.n, "block": smp.block,
               "ci_low": ci.low if ci else None, "ci_high": ci.high if ci else None,
               "no_interval": ci.reason if ci and not ci.exists else None,
               "ci_of": "value" if base is None else "delta",
               "gate": ", ".join(g.bound for g in gates) or None,
               "verdict": "; ".join(g.note.split(":")[0] for g in gates) or None,
               "worst": _worst(gates)}
        if gates and gates[0].kind != ABSOLUTE:  # the gate's own CI is of its compared quantity
            row["ci_low"], row["ci_high"] = gates[0].ci_low, gates[0].ci_high
            row["delta"] = gates[0].delta
            row["delta_kind"] = gates[0].kind
        rows.append(row)
    return rows


def _worst(gates) -> str | None:
    """The row's colour: fail beats inconclusive beats pass."""
    for verdict in (FAIL, INCONCLUSIVE, PASS):
        if any(g.verdict == verdict for g in gates):
            return verdict
    return None


def build_document(report: EvalReport) -> dict[str, Any]:
    """lm-eval's schema at the top level (results, groups, configs, versions, n-shot, higher_is_better,
    n-samples, config) for the candidate; llmopt's own fields (both models' detailed figures, the table's
    rows, gates and verdicts, bootstrap, exit code, timing, cache) under "llmopt"."""
    s, data = report.request.settings, report.data
    cand, base = report.candidate, report.baseline
    results, groups, better = lm_eval_results(cand)
    own: dict[str, Any] = {"model": _model_info(cand), "baseline": _model_info(base) if base else None}
    own["results"], own["groups"] = task_results(cand)
    if base is not None:
        own["baseline_results"], own["baseline_groups"] = task_results(base)
        own["baseline_lm_eval_results"] = lm_eval_results(base)[0]
    doc: dict[str, Any] = {"results": results, "groups": groups}
    configs: dict[str, Any] = {}
    n_samples: dict[str, Any] = {}
    if data.text is not None:
        text_cfg = {"text": data.text.source, "description": data.text.description,
                    "windowing": "llama.cpp llama-perplexity: non-overlapping chunks of ctx_size tokens, second half "
                                 "of each scored, BOS at each chunk's start where the tokenizer adds one",
                    "ctx_size": s.ctx_size, "chunks": len(data.ids) // s.ctx_size, "bos_id": data.bos_id,
                    "tokens": len(data.ids), "scored_tokens": cand.text.num_tokens}
        for task in ("ppl", "kld"):
            if task in s.tasks:
                configs[task] = dict(text_cfg)
                n_samples[task] = {"original": (data.text.num_tokens or len(data.ids)) - 1,
                                   "effective": cand.text.num_tokens}
        if "kld" in configs and cand.endpoint is not None:
            configs["kld"]["candidate_logprobs"] = (
                f"top {cand.endpoint['top_logprobs']} log-probs per position from the endpoint + the observed token's; "
                "KLD over those tokens with each side's remaining probability in one tail bucket: a lower bound of "
                "the full-vocabulary KLD (Δp exact; same top p exact where the top token's text names one id)")
        if "kld" in configs:
            configs["kld"]["baseline_store"] = ("final hidden states per scored token + the dense vocabulary "
                                                "projection, float16; the baseline's full-vocabulary rows rebuilt "
                                                "from them (see eval/kld.py)")
            if base is not None and base.text.store is not None:
                configs["kld"]["baseline_store_error"] = base.text.store.error  # nats of KLD the rounding costs
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
    if cand.mmlu is not None:
        for name, score in cand.mmlu.subjects.items():
            n_samples[f"mmlu_{name}"] = {"original": score.n, "effective": score.n}
    doc.update({
        "configs": configs,
        "versions": {**{t: VERSIONS[t] for t in s.tasks}, "llmopt": __version__},
        "n-shot": {name: s.num_fewshot if name.startswith("mmlu") else 0 for name in results},
        "higher_is_better": better,
        "n-samples": n_samples,
        "config": {"model": "llmopt", "model_args": own["model"]["spec"], "baseline": own["baseline"] and
                   own["baseline"]["spec"], "limit": s.mmlu_limit if data.mmlu is not None else None,
                   "bootstrap_iters": s.bootstrap_samples, "random_seed": s.seed},
    })
    own.update({
        "metrics": metric_rows(report),
        "gates": [asdict(g) for g in report.gates],
        "skipped_gates": report.skipped_gates,
        "gates_source": s.gates_source if report.gates else None,
        "bootstrap": {"samples": s.bootstrap_samples, "seed": s.seed, "level": 0.95, "min_units": stats.MIN_UNITS,
                      "method": "percentile; paired for changes; circular blocks of round(n^(1/3)) tokens for ppl "
                                "and kld, single items for mmlu and humaneval"},
        "strict": s.strict,
        "passed": report.exit_code == 0,
        "exit_code": report.exit_code,
        "timing": {"total_s": round(report.seconds, 2), "candidate": cand.seconds,
                   **({"baseline": base.seconds} if base else {})},
        "cache": {"dir": str(cache.cache_dir()), "baseline": base.cache if base else {}},
    })
    doc["llmopt"] = own
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
    doc = doc["llmopt"]
    title = f"llmopt eval: {doc['model']['spec']}" + (f" vs baseline {doc['baseline']['spec']}" if doc["baseline"] else "")
    table = Table(title=title)
    for col in ("metric", "baseline", "candidate", "Δ", "95% CI", "gate", "verdict"):
        table.add_column(col, justify="right" if col in ("baseline", "candidate", "Δ") else "left", no_wrap=col == "metric")
    for row in doc["metrics"]:
        metric, kind = row["metric"], row["delta_kind"]
        if row.get("no_interval"):
            ci = f"none (n={row['n']} < min)" if row["block"] == 1 else f"none ({row['n']} tokens)"
        elif row["ci_low"] is None:
            ci = "-"
        elif row["ci_of"] == "value":
            ci = f"[{_fmt_value(metric, row['ci_low'])}, {_fmt_value(metric, row['ci_high'])}]"
        else:
            ci = f"[{_fmt_delta(metric, kind, row['ci_low'])}, {_fmt_delta(metric, kind, row['ci_high'])}]"
        verdict = row["verdict"] or ""
        style = {None: "", PASS: "green", INCONCLUSIVE: "yellow", FAIL: "bold red"}[row["worst"]]
        gate = ", ".join(b.partition(":")[2] for b in (row["gate"] or "").split(", ") if b)
        table.add_row(metric.replace(".ppl", "").replace(".acc", ""), _fmt_value(metric, row["baseline"]),
                      _fmt_value(metric, row["candidate"]), _fmt_delta(metric, kind, row["delta"]), ci, gate,
                      f"[{style}]{verdict}[/{style}]" if style else verdict)
    return table


def summary_lines(doc: dict[str, Any]) -> list[str]:
    doc = doc["llmopt"]
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
        failed = [g["bound"] for g in doc["gates"] if g["verdict"] == FAIL]
        unsure = [g["bound"] for g in doc["gates"] if g["verdict"] == INCONCLUSIVE]
        b = doc["bootstrap"]
        lines.append(f"intervals: {b['samples']} bootstrap samples, seed {b['seed']}; none below {b['min_units']} "
                     "items (or token blocks), and such a gate is inconclusive")
        if failed:
            lines.append(f"FAILED (significant: the whole 95% CI beyond the bound): {', '.join(failed)} -> exit 1")
        if unsure:
            consequence = "-> exit 1 (--strict)" if doc["strict"] else "(exit 0 without --strict; --strict fails on them)"
            lines.append(f"INCONCLUSIVE (the CI straddles the bound, or too few items): {', '.join(unsure)} {consequence}")
        if not failed and not unsure:
            lines.append("all gates passed (every 95% CI within its bound)")
    return lines


KLD_ROWS = (("max", "Maximum"), ("p99.9", "99.9%"), ("p99", "99.0%"), ("p95", "95.0%"), ("p90", "90.0%"),
            ("p75", "75.0%"), ("median", "Median"), ("p25", "25.0%"), ("p10", "10.0%"), ("p5", " 5.0%"),
            ("p1", " 1.0%"), ("p0.1", " 0.1%"), ("min", "Minimum"))


def kld_summary_lines(doc: dict[str, Any]) -> list[str]:
    """llama.cpp's `--kl-divergence` summary, same rows, labels and units, from the JSON's results.kld."""
    k = doc["llmopt"]["results"].get("kld")
    if k is None:
        return []
    lines = ["====== Perplexity statistics ======",
             f"Mean PPL(Q)                   : {k['ppl_cand']:10.6f} ± {k['ppl_cand_stderr']:10.6f}",
             f"Mean PPL(base)                : {k['ppl_base']:10.6f} ± {k['ppl_base_stderr']:10.6f}",
             f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * k['ppl_correlation']:6.2f}%",
             f"Mean ln(PPL(Q)/PPL(base))     : {k['ln_ppl_ratio']:10.6f} ± {k['ln_ppl_ratio_stderr']:10.6f}",
             f"Mean PPL(Q)/PPL(base)         : {k['ppl_ratio']:10.6f} ± {k['ppl_ratio_stderr']:10.6f}",
             f"Mean PPL(Q)-PPL(base)         : {k['ppl_diff']:10.6f} ± {k['ppl_diff_stderr']:10.6f}",
             "", "====== KL divergence statistics ======",
             f"Mean    KLD: {k['mean']:10.6f} ± {k['mean_stderr']:10.6f}"]
    lines += [f"{label + ' ' * (7 - len(label))} KLD: {k[key]:10.6f}" for key, label in KLD_ROWS if key in k]
    dp = k["delta_p"]
    lines += ["", "====== Token probability statistics ======",
              f"Mean    Δp: {100 * dp['mean']:6.3f} ± {100 * dp['mean_stderr']:5.3f} %"]
    lines += [f"{label + ' ' * (7 - len(label))} Δp: {100 * dp[key]:6.3f}%" for key, label in KLD_ROWS if key in dp]
    lines += [f"RMS Δp    : {100 * k['rms_delta_p']:6.3f} ± {100 * k['rms_delta_p_stderr']:5.3f} %",
              f"Same top p: {100 * k['same_top_p']:6.3f} ± {100 * k['same_top_p_stderr']:5.3f} %",
              f"({k['num_tokens']} scored tokens, full vocabulary; ± as llama.cpp computes them, tokens taken as "
              "independent: the gates' block-bootstrap intervals are wider)"]
    return lines


# ---------------------------------------------------------------------------- files


def write_json(doc: dict[str, Any], path: Path) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n", encoding="utf-8")


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
        from llmopt.eval.mmlu import build_requests

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
