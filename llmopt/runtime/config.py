"""Engine configuration (vLLM's flag names) and KV pool sizing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from llmopt.errors import LlmoptError
from llmopt.kernels.cpu_linear import FP32_MATMUL_PRECISIONS
from llmopt.options import option
from llmopt.runtime.speculative import SpeculativeConfig

# `--kv-cache-dtype` values (vLLM's flag). fp8 is e4m3 (vLLM's "fp8" / "fp8_e4m3") with a per-layer
# scale of 1.0, vLLM's default where a checkpoint carries no calibrated scales: e4m3 spans +-448, far
# beyond the K/V values of the models served here, and its relative precision does not depend on the
# scale. On the Triton backend the kernels read it in place; elsewhere the PyTorch path widens it.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,  # the model's dtype
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
}


ENGINE_PANEL = "Engine"  # the --help panel of the engine flags


def engine_option(default: Any, help: str, *names: str, **kw: Any) -> Any:
    return option(default, help, *names, panel=ENGINE_PANEL, **kw)


@dataclass
class EngineConfig:
    """The paged runtime's configuration. Each field declared with `engine_option` is also an
    engine flag of every command that runs the runtime (`generate`, `serve`, `eval`, `bench`) and
    a recipe key (`llmopt.options`): a new engine flag is one field here."""

    max_num_seqs: int = engine_option(64, "Most requests running at once.", ge=1)
    max_num_batched_tokens: int = engine_option(1024, "Token budget per step (prompt chunks + decodes).", ge=1)
    max_model_len: Optional[int] = engine_option(None, "Prompt + output limit (default: the model's context).", ge=1)
    block_size: int = engine_option(16, "Tokens per KV block.", ge=1)
    enable_prefix_caching: bool = engine_option(True, "Reuse the KV blocks of prompt prefixes seen before.")
    # bytes for the KV pool; CPU default: 10% of available RAM (EngineArgs takes it as text: "2GiB")
    kv_cache_memory: Optional[int] = None
    gpu_memory_utilization: float = engine_option(0.9, "GPU: fraction of device memory llmopt may use in all.",
                                                  gt=0, le=1)
    num_kv_blocks: Optional[int] = None  # exact pool size (tests, benchmarks); overrides the two above
    kv_cache_dtype: str = engine_option(
        "auto", "KV cache element type: auto (the model's dtype), bfloat16, float16, float32 or fp8 (e4m3); "
        "16-bit on an fp32 model holds twice the tokens, fp8 four times.")
    fp32_matmul_precision: str = engine_option(
        "auto", "float32 models on CPU: what the matrix products of prompt chunks (over 96 rows) compute in: ieee "
        "(float32); bf16 (bfloat16 inputs, float32 sums and results on AMX tiles, 4-6x the float32 "
        "rate per product, logits ~1e-4 nats KLD from ieee on the default model; on AVX512-BF16 without AMX "
        "~1.7x, the decoder's products rounded to bf16 too and prompt attention in bf16 products, ~2e-4 nats); auto: "
        "bf16 where the CPU has "
        "AMX-BF16 or AVX512-BF16, else ieee. Decode steps stay float32; the vocabulary projection is never rounded to bf16.",
        choices=FP32_MATMUL_PRECISIONS)
    enforce_eager: bool = engine_option(
        False, "Run every step eager: no CUDA graphs (on CUDA with the Triton kernels, pure-decode steps replay a "
        "graph per batch-size bucket, captured at start-up).", "--enforce-eager")
    max_seq_len_to_capture: int = engine_option(
        8192, "Longest context a CUDA graph covers (the graphs' block tables); decode steps with a longer one run "
        "eager.", ge=1)
    # speculative decoding: a SpeculativeConfig, or its keys as a dict (vLLM's speculative_config);
    # EngineArgs builds it from the speculative flags
    speculative_config: SpeculativeConfig | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.from_value(self.speculative_config)
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_seq_len_to_capture"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LlmoptError(f"{name} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise LlmoptError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise LlmoptError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise LlmoptError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise LlmoptError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.fp32_matmul_precision not in FP32_MATMUL_PRECISIONS:
            raise LlmoptError(f"unknown fp32_matmul_precision {self.fp32_matmul_precision!r}; choose one of: "
                              f"{', '.join(FP32_MATMUL_PRECISIONS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise LlmoptError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; choose one of: "
                              f"{', '.join(KV_CACHE_DTYPES)}")


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's element type for `kv_cache_dtype` `name` and a model computing in `model_dtype`.

    A pool wider than the model is refused: K/V are computed in the model's dtype, so it would
    hold the same values in twice the memory.
    """
    if name not in KV_CACHE_DTYPES:
        raise LlmoptError(f"unknown kv_cache_dtype {name!r}; choose one of: {', '.join(KV_CACHE_DTYPES)}")
    dtype = KV_CACHE_DTYPES[name] or model_dtype
    if dtype.itemsize > model_dtype.itemsize:
        valid = ["auto"] + [n for n, d in KV_CACHE_DTYPES.items()
                            if d is not None and d.itemsize <= model_dtype.itemsize]
        model_name = str(model_dtype).removeprefix("torch.")
        raise LlmoptError(f"kv_cache_dtype {name} is wider than the model's {model_name}: K/V are computed in "
                          f"{model_name}, so it would only double the cache; choose one of: {', '.join(valid)}")
    return dtype


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else a conservative 4 GiB."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def parse_bytes(text: str) -> int:
    """'2GiB', '512MB', '1e9' -> bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1,
             "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    s = text.strip().lower().replace(" ", "")
    for unit in sorted(units, key=len, reverse=True):
        if s.endswith(unit):
            number, scale = s[: -len(unit)], units[unit]
            break
    else:
        number, scale = s, 1
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise LlmoptError(f"cannot read {text!r} as a size (examples: 2GiB, 512MiB, 1e9)") from None
    if value <= 0:
        raise LlmoptError(f"size must be positive, got {text!r}")
    return value
