"""The recipe schema: one YAML file drives quantize -> eval -> bench -> serve (`llmopt run`).

Every section mirrors the command it drives, its keys being that command's flag names with
`_` for `-` (`group_size` for `--group-size`). A key left out (or null) means the command's
own default, so a recipe states only what it changes and `commands.sh` repeats only those
flags. Unknown keys are errors (`extra="forbid"`); values are checked for type here and for
meaning (method names, gate syntax, ...) by the library that runs them, before any stage runs.

    name, description     free text
    extends               another recipe (a path relative to this file), deep-merged under this one
    model                 the source model: a spec string, or {spec, dtype, device} (device and dtype
                          are every stage's default)
    quantize              `llmopt quantize` options; `calibration`: source (--calib), num_samples,
                          seq_len, seed
    eval                  `llmopt eval` options: tasks, gates (today's gate syntax, eval/gates/spec.py), task
                          options, baseline (default: the source model when the recipe quantizes)
    bench                 a plan: `throughput`, `latency` and `serve` (`llmopt bench ...`), each with its
                          options; they run in that order, those present only
    serve                 `llmopt serve` flags; `llmopt run --serve` starts it, else commands.sh holds it
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, NonNegativeInt, PositiveInt, model_validator


def _comma_list(value: Any) -> Any:
    """'a,b' -> ['a', 'b'] (the CLI's comma-separated form); lists pass through."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [value]
    return value


def _gate_list(value: Any) -> Any:
    # a bare string is one comma-separated `--gate` spec; numbers are refused below (YAML drops the sign of +0.5)
    return [value] if isinstance(value, str) else value


Names = Annotated[list[str], BeforeValidator(_comma_list)]
Ints = Annotated[list[int], BeforeValidator(_comma_list)]
Gates = Annotated[list[str], BeforeValidator(_gate_list)]
Positive = PositiveInt
Count = NonNegativeInt


class Section(BaseModel):
    """Unknown keys are errors; values are type-checked as they come (no silent coercion of numbers to text)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def given(self, *exclude: str) -> dict[str, Any]:
        """The keys the recipe set (not null), nested sections excluded by name."""
        return {k: v for k, v in self.model_dump(exclude=set(exclude)).items() if v is not None}


class EngineFlags(Section):
    """The paged runtime's options (vLLM's names), as `llmopt generate/eval/bench/serve` take them."""

    max_num_seqs: Positive | None = None
    max_num_batched_tokens: Positive | None = None
    max_model_len: Positive | None = None
    block_size: Positive | None = None
    enable_prefix_caching: bool | None = None
    kv_cache_memory: str | None = None  # "2GiB"
    kv_cache_dtype: str | None = None
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    dtype: str | None = None  # default: model.dtype
    device: str | None = None  # default: model.device
    speculative_model: str | None = None
    speculative_method: Literal["ngram", "draft_model"] | None = None
    num_speculative_tokens: Positive | None = None
    prompt_lookup_min: Positive | None = None
    prompt_lookup_max: Positive | None = None
    speculative_disable_by_batch_size: Positive | None = None
    speculative_allow_mismatch: bool | None = None


ENGINE_FLAGS = tuple(EngineFlags.model_fields)


class ModelSection(Section):
    spec: str
    dtype: str | None = None
    device: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _from_spec(cls, value: Any) -> Any:
        return {"spec": value} if isinstance(value, str) else value


class Calibration(Section):
    source: str | None = None  # --calib: self, a .txt/.jsonl/.parquet file, hf:NAME[:CONFIG][:SPLIT]
    num_samples: Positive | None = None
    seq_len: Positive | None = None
    seed: Count | None = None


class QuantizeSection(Section):
    method: Literal["rtn", "awq", "gptq", "gguf"]
    format: Literal["awq", "gptq", "gguf"] | None = None
    bits: Positive | None = None
    group_size: int | None = None
    sym: bool | None = None
    desc_act: bool | None = None
    damp_percent: float | None = None
    gguf_type: str | None = None
    quantize_lm_head: bool | None = None
    device: str | None = None  # default: model.device
    calibration: Calibration = Calibration()
    output: str | None = None  # the checkpoint's name inside the run folder (default: model, or model.gguf)


class EvalSection(EngineFlags):
    baseline: str | None = None  # default: the source model when the recipe quantizes; "none": no baseline
    tasks: Names | None = None
    gates: Gates | None = None  # None: the default gates (llmopt/recipes/default-gates.yaml); [] : none
    limit: int | float | str | None = None  # MMLU questions per subject and HumanEval problems
    text: str | None = None
    ctx_size: Positive | None = None
    chunks: Positive | Literal["all"] | None = None
    mmlu_path: str | None = None
    num_fewshot: Count | None = None
    mmlu_limit: int | float | str | None = None
    humaneval_limit: int | float | str | None = None
    humaneval_mode: Literal["completion", "chat"] | None = None
    humaneval_samples: Positive | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: Count | None = None
    bootstrap_samples: Positive | None = None
    strict: bool | None = None
    pass_k: Ints | None = None
    humaneval_max_tokens: Positive | None = None
    timeout: float | None = Field(None, gt=0)
    cache: bool | None = None  # --cache/--no-cache: the baseline's cached results


# The keys of `eval` that are task settings (eval/recipe.py's EvalSettings), not run options.
EVAL_RUN_KEYS = frozenset({"baseline", "cache", *ENGINE_FLAGS})


class ThroughputPlan(EngineFlags):
    engines: Names | None = None
    dataset: str | None = None
    num_prompts: Positive | None = None
    input_len: Positive | None = None
    output_len: Count | None = None
    range_ratio: float | None = Field(None, ge=0, lt=1)
    prefix_len: Count | None = None
    seed: Count | None = None
    hf_batch_size: Positive | None = None
    hf_max_requests: Count | None = None
    gguf: str | None = None
    threads: Positive | None = None


class LatencyPlan(Section):
    engines: Names | None = None
    batch_size: Ints | None = None
    input_len: Positive | None = None
    output_len: Positive | None = None
    num_iters_warmup: Count | None = None
    num_iters: Positive | None = None
    seed: Count | None = None
    gguf: str | None = None
    threads: Positive | None = None
    max_num_batched_tokens: Positive | None = None
    block_size: Positive | None = None
    kv_cache_memory: str | None = None
    kv_cache_dtype: str | None = None
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    dtype: str | None = None
    device: str | None = None


class ServeBenchPlan(Section):
    url: str | None = None  # a running server; default: launch `llmopt serve CHECKPOINT <serve flags>`
    launch: Literal["llmopt", "llama-cpp"] | None = None
    serve_args: str | None = None  # default: the recipe's serve flags
    served_model_name: str | None = None
    endpoint: Literal["chat", "completions"] | None = None
    dataset: str | None = None
    num_prompts: Positive | None = None
    input_len: Positive | None = None
    output_len: Count | None = None
    range_ratio: float | None = Field(None, ge=0, lt=1)
    prefix_len: Count | None = None
    tokenizer: str | None = None
    seed: Count | None = None
    request_rate: float | None = Field(None, gt=0)
    burstiness: float | None = Field(None, gt=0)
    max_concurrency: Positive | None = None
    sweep: str | None = None  # concurrency=1,4,16 or rate=1,2,inf
    num_warmups: Count | None = None
    temperature: float | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    percentiles: Annotated[list[float], BeforeValidator(_comma_list)] | None = None
    goodput: Names | None = None  # ["ttft:500", "tpot:50"]
    cost_per_hour: float | None = Field(None, ge=0)
    timeout: float | None = Field(None, gt=0)
    server_timeout: float | None = Field(None, gt=0)
    save_detailed: bool | None = None


class BenchSection(Section):
    throughput: ThroughputPlan | None = None
    latency: LatencyPlan | None = None
    serve: ServeBenchPlan | None = None


class ServeSection(EngineFlags):
    engine: Literal["llmopt", "llama.cpp", "vllm"] | None = None
    host: str | None = None
    port: int | None = Field(None, gt=0, lt=65536)
    tensor_parallel_size: Positive | None = None
    quantization: str | None = None
    served_model_name: str | None = None
    max_queue: Positive | None = None
    log_requests: bool | None = None


class Recipe(Section):
    name: str | None = None
    description: str | None = None
    model: ModelSection | None = None
    quantize: QuantizeSection | None = None
    eval: EvalSection | None = None
    bench: BenchSection | None = None
    serve: ServeSection | None = None
