"""The eval report as one JSON document in lm-evaluation-harness's schema (the table is `table.py`).

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
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from llmopt import __version__
from llmopt.core.atomic import atomic_file
from llmopt.eval import cache
from llmopt.eval.gates import stats
from llmopt.eval.gates.judge import display_kind
from llmopt.eval.gates.spec import ABSOLUTE, RELATIVE
from llmopt.eval.gates.verdict import FAIL, INCONCLUSIVE, PASS
from llmopt.eval.run import EvalReport, metric_samples, shown_metrics
from llmopt.eval.tasks import ModelRun

# Bumped when a task's scoring changes in a way that moves its numbers.
VERSIONS = {"ppl": 1, "kld": 1, "mmlu": 1, "humaneval": 1}


def _model_info(run: ModelRun) -> dict[str, Any]:
    if run.samples_file is not None:  # completions scored from a file: no model
        return {"spec": run.spec, "kind": "samples", "path": run.samples_file}
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
                                "max_tokens": s.humaneval_max_tokens, "pass_k": s.pass_k, "timeout_s": s.timeout,
                                "sandbox": report.request.options.sandbox}
        if cand.samples_file is not None:
            configs["humaneval"].update(samples_file=cand.samples_file, temperature=None, top_p=None, seed=None,
                                        max_tokens=None)
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


def write_json(doc: dict[str, Any], path: Path) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n", encoding="utf-8")
