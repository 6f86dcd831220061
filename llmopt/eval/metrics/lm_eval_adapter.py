"""lm-evaluation-harness on llmopt's runtime: an `lm_eval.api.model.LM` over our decoder and engine.

`lm_eval.simple_evaluate(model=LlmoptLM(loaded), tasks=[...])` runs lm-eval's own tasks
(HellaSwag, ARC, GSM8K, MMLU, or local YAML tasks through
`TaskManager(include_path=DIR)`) on llmopt, instead of re-implementing them one by one:

- `loglikelihood`: (context, continuation) pairs through `loglikelihood.py` (lm-eval's
  `_encode_pair` tokenization, BOS before each context where the tokenizer adds one or
  `add_bos` says, an empty context becomes BOS or EOS; packed, batched forwards), with
  lm-eval's `is_greedy`;
- `loglikelihood_rolling`: lm-eval's own rolling windows (`get_rolling_token_windows` +
  `make_disjoint_window`, windows of the model's context, EOS as the prefix token, as
  HFLM does when it adds no BOS), scored the same way and summed per document;
- `generate_until`: the paged runtime (`runtime.LLM`), all requests in one continuously
  batched run: greedy unless `do_sample`, stopping at `until` and the model's EOS, at most
  `max_gen_toks` tokens, the prompt left-truncated to leave room for them.

`evaluate_tasks` runs a list of tasks through `simple_evaluate` (what `llmopt eval --tasks
lm-eval:TASK` calls). Rolling windows and generation prompts get no BOS yet (HFLM adds the
tokenizer's default there too).

lm-eval is an optional extra (`pip install 'llmopt[lm-eval]'`, lm-eval 0.4.x).
"""

from __future__ import annotations

from typing import Any

from lm_eval.api.model import LM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from llmopt.eval.metrics.loglikelihood import DEFAULT_BATCH_TOKENS, plan_jobs, run_jobs, token_jobs

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default when a task gives none


class LlmoptLM(LM):
    """A loaded llmopt model (`core.load`) as an lm-eval language model."""

    def __init__(self, loaded, engine: dict[str, Any] | None = None, batch_tokens: int = DEFAULT_BATCH_TOKENS,
                 add_bos: bool | None = None):
        super().__init__()
        from llmopt.eval.metrics.text import context_bos_id

        self.loaded = loaded
        self.bos_id = context_bos_id(loaded.tokenizer, add_bos)  # lm-eval's add_bos_token (None: the tokenizer's)
        self.engine_config = dict(engine or {})
        self.batch_tokens = batch_tokens
        self._llm = None

    @property
    def max_length(self) -> int:
        return self.loaded.config.max_position_embeddings

    @property
    def eot_token_id(self) -> int:
        return (self.loaded.tokenizer.eos_token_ids or [0])[0]

    @property
    def tokenizer_name(self) -> str:
        return str(self.loaded.source.spec)

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        pairs = [tuple(req.args) for req in requests]
        if not pairs:
            return []
        jobs, _ = plan_jobs(self.loaded.tokenizer, pairs, self.max_length, self.bos_id)
        totals, greedy = run_jobs(self.loaded.model, jobs, len(pairs), self.batch_tokens)
        return list(zip(totals, greedy))

    def loglikelihood_rolling(self, requests) -> list[float]:
        windows, owner = [], []
        for i, req in enumerate(requests):
            (text,) = req.args[:1]
            ids = self.loaded.tokenizer.encode(text, add_special_tokens=False)
            for window in get_rolling_token_windows(ids, self.eot_token_id, self.max_length, 1):
                windows.append(make_disjoint_window(window))
                owner.append(i)
        if not windows:
            return [0.0] * len(requests)
        totals, _ = run_jobs(self.loaded.model, token_jobs(windows, self.max_length), len(windows), self.batch_tokens)
        out = [0.0] * len(requests)
        for i, value in zip(owner, totals):
            out[i] += value
        return out

    def generate_until(self, requests) -> list[str]:
        from llmopt.runtime import LLM, SamplingParams

        if self._llm is None:
            self._llm = LLM(self.loaded, **self.engine_config)
        prompts, params = [], []
        for req in requests:
            context, kwargs = req.args[0], dict(req.args[1] if len(req.args) > 1 else {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
            sample = bool(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 1.0 if sample else 0.0))
            ids = self.loaded.tokenizer.encode(context, add_special_tokens=False) or [self.eot_token_id]
            ids = ids[-max(1, self.max_length - max_new):]  # HFLM's left truncation
            prompts.append(ids)
            params.append(SamplingParams(max_tokens=max(1, min(max_new, self.max_length - len(ids))),
                                         temperature=temperature if sample else 0.0,
                                         top_p=float(kwargs.pop("top_p", 1.0)), stop=until or None,
                                         seed=int(kwargs.pop("seed", 0))))
        outputs = self._llm.generate(prompts, params) if prompts else []
        texts = []
        for out, stops in zip(outputs, (p.stop or [] for p in params)):
            text = "" if out.error else out.outputs[0].text
            for stop in stops:  # lm-eval cuts at the first stop sequence, which the engine may have kept
                text = text.split(stop)[0]
            texts.append(text)
        return texts


def evaluate_tasks(loaded, tasks: list[str], *, include_path: str | None = None, num_fewshot: int | None = None,
                   limit: int | float | None = None, engine: dict[str, Any] | None = None,
                   add_bos: bool | None = None, log_samples: bool = False) -> dict[str, Any]:
    """lm-eval's own tasks (and those under `include_path`) on a loaded model: `simple_evaluate`'s output
    (results, n-shot, higher_is_better, configs, versions, n-samples; samples when `log_samples`)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from llmopt.errors import LlmoptError

    manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" or under --lm-eval-include-path {include_path}" if include_path else ""
        raise LlmoptError(f"lm-eval has no task {', '.join(unknown)}{where} (offline, a hub-backed task also needs "
                          "its data in the datasets cache)")
    return simple_evaluate(model=LlmoptLM(loaded, engine=engine, add_bos=add_bos), tasks=tasks, task_manager=manager,
                           num_fewshot=num_fewshot, limit=limit, log_samples=log_samples)
