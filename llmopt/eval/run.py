"""`llmopt eval` end to end: check the request, load the data, run baseline then candidate, judge the gates.

Everything that can be wrong with the input (tasks, limits, gates, data files, model
specs, a tokenizer mismatch for ppl/kld) is checked before any model runs, so a typo costs
seconds, not a baseline pass. Then the baseline runs (mostly from its cache), then the
candidate; each model is freed before the next loads.

Gates compare the two models on the same items (`metric_samples`): per-token NLL for
perplexity, per-position KLD (candidate only: KLD is already a comparison), per-question
0/1 for MMLU, per-problem pass@k for HumanEval.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from llmopt.core.source import ModelSource, resolve
from llmopt.core import load_tokenizer
from llmopt.errors import LlmoptError
from llmopt.eval.gates import stats
from llmopt.eval.gates.judge import Bootstrap, MetricSamples, display_kind, evaluate_gates
from llmopt.eval.gates.spec import ABSOLUTE, Gate, parse_gates
from llmopt.eval.gates.verdict import GateResult, exit_code
from llmopt.eval.metrics.text import bos_id, load_text, tokenize
from llmopt.eval.settings import DEFAULTS, EvalSettings
from llmopt.eval.tasks import (BASELINE, CANDIDATE, EvalData, ModelRun, RunOptions, limit_count, run_endpoint,
                                run_model, run_samples_file)

if TYPE_CHECKING:
    from llmopt.eval.endpoint import EndpointConfig

log = logging.getLogger("llmopt.eval")


@dataclass
class EvalRequest:
    model: str | None  # with `endpoint`: the local model the endpoint serves, for its tokenizer (None: the baseline's)
    baseline: str | None
    settings: EvalSettings
    options: RunOptions = field(default_factory=RunOptions)
    endpoint: EndpointConfig | None = None  # the candidate is this served model (`--base-url`), not a local one
    samples: Path | None = None  # HumanEval completions to score (`--samples`): no model at all


@dataclass
class EvalReport:
    request: EvalRequest
    data: EvalData
    candidate: ModelRun
    baseline: ModelRun | None
    gates: list[GateResult]
    skipped_gates: list[str]
    intervals: dict[str, stats.Interval]  # metric -> CI of its shown change (`display_kind`) or value
    seconds: float

    @property
    def exit_code(self) -> int:
        return exit_code(self.gates, strict=self.request.settings.strict)


# ---------------------------------------------------------------------------- checks


def resolve_gates(s: EvalSettings, has_baseline: bool) -> tuple[list[Gate], list[str]]:
    """The gates to judge and those skipped (recipe/default gates of tasks that do not run)."""
    if s.gates is None:
        if not has_baseline:
            return [], []
        specs, strict = DEFAULTS["gates"], False
    elif isinstance(s.gates, str) and s.gates.strip().lower() == "none" or s.gates == []:
        return [], []
    else:
        specs, strict = s.gates, s.gates_source == "flag"
    gates, skipped = [], []
    for gate in parse_gates(specs):
        task = gate.metric.partition(".")[0]
        if task not in s.tasks:
            if strict:
                raise LlmoptError(f"gate {gate.text} needs task {task}, which is not in --tasks ({','.join(s.tasks)})")
            skipped.append(gate.text)
            continue
        if gate.kind != ABSOLUTE and not has_baseline:
            raise LlmoptError(f"gate {gate.text} compares with a baseline: pass --baseline MODEL, or give an absolute "
                              f"threshold such as {gate.metric}:{'>=' if gate.info.higher_is_better else '<='}VALUE")
        if task == "humaneval":
            k = int(gate.metric.partition("@")[2])
            if k not in s.pass_k:
                raise LlmoptError(f"gate {gate.text}: pass@{k} is not computed; add {k} to --pass-k "
                                  f"(with --humaneval-samples >= {k})")
        gates.append(gate)
    return gates, skipped


def check_same_tokenizer(cand: ModelSource, base: ModelSource, cand_tok, base_tok, text_ids: list[int],
                         base_ids: list[int], tasks: list[str]) -> None:
    """ppl and kld compare the models token by token: they need the same vocabulary and tokenization."""
    which = "/".join(t for t in tasks if t in ("ppl", "kld"))
    why = (f"cannot compare {cand.spec} with baseline {base.spec} on {which}: "
           "KL divergence compares the two next-token distributions position by position and paired perplexity "
           "compares per-token losses, so both models must share one tokenizer")
    fix = "; gate this pair on mmlu/humaneval instead (--tasks mmlu,humaneval)"
    if cand.config.vocab_size != base.config.vocab_size:
        raise LlmoptError(f"{why}, but their vocabularies have {cand.config.vocab_size} and "
                          f"{base.config.vocab_size} entries{fix}")
    if cand_tok.backend.get_vocab(with_added_tokens=True) != base_tok.backend.get_vocab(with_added_tokens=True):
        raise LlmoptError(f"{why}, but their vocabularies map tokens to different ids{fix}")
    if text_ids != base_ids:
        at = next((i for i, (a, b) in enumerate(zip(text_ids, base_ids)) if a != b), min(len(text_ids), len(base_ids)))
        raise LlmoptError(f"{why}, but they encode the evaluation text differently (first difference at token {at}){fix}")


def load_data(s: EvalSettings, tokenizer) -> EvalData:
    data = EvalData()
    if "ppl" in s.tasks or "kld" in s.tasks:
        data.text = load_text(s.text)
        data.ids = tokenize(tokenizer, data.text, s.ctx_size, s.chunks)
        data.bos_id = bos_id(tokenizer)
    if "mmlu" in s.tasks:
        from llmopt.eval.metrics.mmlu import apply_limit, build_requests, load_mmlu

        questions = load_mmlu(s.mmlu_path)
        data.mmlu_total = len(questions)
        data.mmlu = apply_limit(questions, s.mmlu_limit)
        data.mmlu_dev = load_mmlu(s.mmlu_path, split="dev") if s.num_fewshot > 0 else None
        build_requests(data.mmlu, s.num_fewshot, data.mmlu_dev)  # few-shot errors now, not after the baseline
    if "humaneval" in s.tasks:
        from llmopt.eval.metrics.humaneval import load_problems

        problems = load_problems()
        data.problems_total = len(problems)
        data.problems = problems[:limit_count(len(problems), s.humaneval_limit)]
    return data


# ---------------------------------------------------------------------------- gates


def metric_samples(metric: str, cand: ModelRun, base: ModelRun | None) -> MetricSamples:
    """Per-item values of `metric` (canonical name) for both models, paired by item."""
    task, _, leaf = metric.partition(".")
    if task == "ppl":
        return MetricSamples(cand.text.nll, base.text.nll if base else None, transform=np.exp if leaf == "ppl" else None,
                             token_level=True)
    if task == "kld":
        k = cand.text.kld
        if leaf == "same_top_p":
            return MetricSamples(np.asarray(k.same_top, dtype=np.float64), token_level=True)
        values = np.asarray(k.per_position, dtype=np.float64)
        if leaf == "mean":
            return MetricSamples(values, token_level=True)
        quantile = {"median": 0.5, "max": 1.0}.get(leaf)
        return MetricSamples(values, quantile=float(leaf[1:]) / 100 if quantile is None else quantile, token_level=True)
    if task == "mmlu":
        return MetricSamples(np.asarray(cand.mmlu.correct, float), np.asarray(base.mmlu.correct, float) if base else None)
    if task == "humaneval":
        k = int(leaf.partition("@")[2])
        return MetricSamples(np.asarray(cand.humaneval.per_problem(k)),
                             np.asarray(base.humaneval.per_problem(k)) if base else None)
    raise LlmoptError(f"no samples for metric {metric}")


def shown_metrics(tasks: list[str], pass_k: list[int]) -> list[str]:
    """The metrics of the report table, in order."""
    out = []
    for task in tasks:
        out += {"ppl": ["ppl.ppl"], "kld": ["kld.mean", "kld.p99", "kld.same_top_p"], "mmlu": ["mmlu.acc"],
                "humaneval": [f"humaneval.pass@{k}" for k in pass_k]}[task]
    return out


# ---------------------------------------------------------------------------- the run


def check_sandbox(mode: str) -> None:
    """HumanEval's sandbox, before any model loads: refused (exit 2) where the machine cannot make it,
    unless --unsafe-sandbox asked for the in-process guard alone."""
    from llmopt.eval.sandbox.runner import SANDBOX, sandbox_mode

    if mode == SANDBOX:
        sandbox_mode()
    else:
        log.warning("--unsafe-sandbox: HumanEval programs run WITHOUT the OS sandbox, guarded only in-process; "
                    "model-written code can undo that guard, read your files and reach the network")


def _score_samples_file(request: EvalRequest, gates: list[Gate], skipped: list[str], start: float) -> EvalReport:
    """`--samples FILE`: HumanEval on given completions, no model; absolute gates only."""
    s = request.settings
    if s.tasks != ["humaneval"]:
        raise LlmoptError("--samples scores HumanEval completions: use it with --tasks humaneval alone")
    if request.model is not None or request.baseline is not None or request.endpoint is not None:
        raise LlmoptError("--samples scores a file of completions: give no MODEL, --baseline or --base-url with it")
    if not request.samples.is_file():
        raise LlmoptError(f"--samples {request.samples}: no such file")
    check_sandbox(request.options.sandbox)
    data = load_data(s, None)
    cand = run_samples_file(request.samples, data, s, request.options)
    return _judge(request, data, cand, None, gates, skipped, start)


def _judge(request: EvalRequest, data: EvalData, cand: ModelRun, base: ModelRun | None, gates: list[Gate],
           skipped: list[str], start: float) -> EvalReport:
    """The gates' verdicts and every shown metric's interval, paired by item."""
    s = request.settings
    samples = {m: metric_samples(m, cand, base) for m in {g.metric for g in gates} | set(shown_metrics(s.tasks, s.pass_k))}
    bootstrap = Bootstrap(n_boot=s.bootstrap_samples, seed=s.seed)  # one bootstrap per metric and kind, shared
    results = evaluate_gates(gates, {m: samples[m] for m in {g.metric for g in gates}}, bootstrap)
    intervals = {m: bootstrap.interval(m, smp, display_kind(m, smp)) for m, smp in samples.items()}
    return EvalReport(request, data, cand, base, results, skipped, intervals, time.perf_counter() - start)


def run_eval(request: EvalRequest) -> EvalReport:
    start = time.perf_counter()
    s, options = request.settings, request.options
    gates, skipped = resolve_gates(s, request.baseline is not None)
    for text in skipped:
        log.debug("gate %s skipped: its task is not in --tasks", text)
    if request.samples is not None:
        return _score_samples_file(request, gates, skipped, start)
    if request.baseline is not None and request.baseline.startswith(("http://", "https://")):
        # gating a served model against the local checkpoint it came from keeps the baseline's full distributions
        # (exact KLD rows, its cache); two endpoints would leave KLD with top-k on both sides
        raise LlmoptError("--baseline is a local model (its results are cached); a served candidate goes in "
                          "--base-url")
    if request.endpoint is not None:
        if request.model is None and request.baseline is None:
            raise LlmoptError("--base-url needs the tokenizer of the model it serves: give that model as MODEL, "
                              "or a --baseline that shares its tokenizer")
        if "humaneval" in s.tasks:
            raise LlmoptError("--base-url scores ppl, kld and mmlu; humaneval runs on a local model only: "
                              "leave it out of --tasks")
    elif request.model is None:
        raise LlmoptError("give MODEL (a spec, folder or .gguf), or --base-url URL to evaluate a served model")
    if "humaneval" in s.tasks:
        check_sandbox(options.sandbox)
    cand_source = resolve(request.model if request.model is not None else request.baseline)
    base_source = resolve(request.baseline) if request.baseline is not None else None
    cand_tok = load_tokenizer(cand_source)
    data = load_data(s, cand_tok)
    if base_source is not None and data.ids is not None:
        base_tok = load_tokenizer(base_source)
        base_ids = tokenize(base_tok, data.text, s.ctx_size, s.chunks).tolist()
        check_same_tokenizer(cand_source, base_source, cand_tok, base_tok, data.ids.tolist(), base_ids, s.tasks)
    if "ppl" in s.tasks or "kld" in s.tasks:
        for source in filter(None, (cand_source, base_source)):
            if s.ctx_size > source.config.max_position_embeddings:
                raise LlmoptError(f"--ctx-size {s.ctx_size} exceeds {source.spec}'s context of "
                                  f"{source.config.max_position_embeddings} tokens")

    endpoint = None
    if request.endpoint is not None:
        from llmopt.eval.endpoint import Endpoint

        if data.ids is not None and s.ctx_size + 1 > cand_source.config.max_position_embeddings:
            raise LlmoptError(f"--ctx-size {s.ctx_size}: through --base-url a chunk and the one token the endpoint "
                              f"generates must fit {cand_source.spec}'s context of "
                              f"{cand_source.config.max_position_embeddings} tokens")
        endpoint = Endpoint(request.endpoint, cand_tok)
        endpoint.check(request.endpoint.top_logprobs if "kld" in s.tasks else 0)  # before any baseline work

    base = None
    if base_source is not None:
        base = run_model(BASELINE, base_source, s.tasks, data, s, options)
    if endpoint is not None:
        cand = run_endpoint(CANDIDATE, endpoint, cand_source, s.tasks, data, s, options.add_bos, base=base)
    else:
        cand = run_model(CANDIDATE, cand_source, s.tasks, data, s, options, base=base)
    return _judge(request, data, cand, base, gates, skipped, start)
