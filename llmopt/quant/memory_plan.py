"""The RAM a quantize run will need, from the config alone, against what the machine has:
stated before any weight is read, and a refusal (exit 2, one line with both numbers) when it
cannot fit, instead of the kernel's OOM killer an hour in.

The estimate follows what is resident at the peak of the streaming path (`streaming.py`):
one decoder layer in the compute dtype and the quantizer's copies of its largest weight
(GPTQ: two [in, in] float32 matrices of its widest input, the Hessian and its factor);
the calibration activations (the residual stream, the MLP's intermediates and the
quantizer's float32 copy of a linear's input, all [samples x seq_len, width]); a chunk of
the embedding table; and the interpreter with torch loaded. `--calib self` needs the whole
model in float32 first (it generates its own calibration text, then frees it).

GGUF export writes each tensor as it arrives (gguf_export.py): `--method gguf` holds one
checkpoint tensor in float32 (plus its q/k-permuted copy) and its quantized bytes, no layer;
AWQ into GGUF adds the layer's unrounded weights the export quantizes. The K-quant types are
then quantized by llama.cpp from an F16 scratch file, a later phase that holds the largest
tensor (the embedding table, usually) as float32 plus a work buffer of the same size. Where a
run has phases, the plan is the largest. It is an estimate: 15% headroom is added, and
LLMOPT_MEMORY_CHECK=0 skips the refusal.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from llmopt.core.config import ModelConfig
from llmopt.core.memory import available_memory_bytes as available_memory
from llmopt.errors import LlmoptError
from llmopt.quant.gguf_export import K_QUANT_TYPES

log = logging.getLogger("llmopt")

BASELINE_BYTES = 600 * 2**20  # python + torch + llmopt imported, measured ~450 MB on CPU
HEADROOM = 1.15
GIB = 2**30


@dataclass
class MemoryPlan:
    """Bytes a run needs, by part, and what the machine has free."""

    parts: dict[str, int] = field(default_factory=dict)
    available: int | None = None

    @property
    def needed(self) -> int:
        return int(sum(self.parts.values()) * HEADROOM)

    def describe(self) -> str:
        biggest = sorted(self.parts.items(), key=lambda kv: -kv[1])[:3]
        shown = ", ".join(f"{name} {size / GIB:.1f}" for name, size in biggest)
        have = "unknown" if self.available is None else f"{self.available / GIB:.1f} GiB"
        return f"needs about {self.needed / GIB:.1f} GiB (GiB: {shown}); available: {have}"

    def to_dict(self) -> dict:
        return {"needed_bytes": self.needed, "available_bytes": self.available, "parts": dict(self.parts)}


def quantize_plan(config: ModelConfig, method: str, fmt: str, num_samples: int, seq_len: int,
                  dtype: torch.dtype, calib_self: bool, quantize_lm_head: bool,
                  gguf_type: str | None = None, calibrated: bool | None = None) -> MemoryPlan:
    """What `llmopt quantize` holds at its peak (see the module docstring); `calibrated`: the
    method runs calibration samples through the layers (default: AWQ and GPTQ)."""
    calibrated = method in ("awq", "gptq") if calibrated is None else calibrated
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    b = dtype.itemsize
    layer = h * (q + 2 * kv) + q * h + 3 * h * i
    largest = max(h * (q + 2 * kv), q * h, 2 * i * h)
    parts = {"interpreter": BASELINE_BYTES}
    if method == "gguf":
        # one checkpoint tensor (q, k, v, gate, up apart) in float32 and its permuted copy or quantized
        # bytes; or a row chunk of the embedding table / lm_head: read, float32, quantized (<= 4 bytes each)
        parts["tensor"] = max(max(q * h, i * h) * (4 + 4), 8192 * h * 12)
    else:
        parts["layer"] = layer * b + 3 * largest * 4
        parts["embedding chunk"] = 8192 * h * 8
    if method == "gptq":
        # the widest input's Hessian [in, in] float32 and the factorisation's second matrix (gptq.py)
        parts["hessian"] = 2 * max(h, q, i) ** 2 * 4
    if calibrated:
        tokens = num_samples * seq_len
        # the residual and the MLP's normed input (h each) beside, at the larger of: gate/up's output
        # and its silu product (2i + i) in the compute dtype; or at down_proj's hook the product (i),
        # the hook's float32 copy of it where the compute dtype is not float32 (AWQ scales that copy
        # in place) and the bf16 copy the backend's bf16 products make of it
        at_hook = i * b + (i * 4 if b != 4 else 0) + i * 2
        parts["activations"] = tokens * (2 * h * b + max(3 * i * b, at_hook))
        parts["attention"] = tokens * (q + 2 * kv) * b * 2
    if fmt == "gguf" and method != "gguf":
        # AWQ's scaled weights before rounding, kept for the GGUF types to round; one tensor's GGUF copy
        parts["unrounded weights"] = layer * b + largest * 4
    if quantize_lm_head and method != "gguf":
        parts["lm_head"] = config.vocab_size * h * (b + 3 * 4)
    phases = [parts]
    params = config.num_parameters
    if calibrated and calib_self:
        # the model is loaded whole to write the calibration text, and freed before the layers stream
        phases.append({"interpreter": BASELINE_BYTES, "model for --calib self": params * 4})
    if fmt == "gguf" and gguf_type in K_QUANT_TYPES:
        # llama.cpp's quantizer, after the stream: its largest tensor widened to float32, a work buffer
        # as large, and that tensor's F16 bytes (the scratch file is memory-mapped)
        biggest = max(config.vocab_size * h, i * h, q * h)
        phases.append({"interpreter": BASELINE_BYTES, f"llama.cpp {gguf_type} of the largest tensor": biggest * 10})
    return MemoryPlan(parts=max(phases, key=lambda phase: sum(phase.values())))


def check_fits(plan: MemoryPlan, what: str, hint: str) -> MemoryPlan:
    """Log the plan; refuse (LlmoptError: exit 2) when it needs more than is available."""
    plan.available = available_memory()
    if plan.available is not None and plan.needed > plan.available and os.environ.get("LLMOPT_MEMORY_CHECK") != "0":
        raise LlmoptError(f"{what} {plan.describe()}, so it would be killed for lack of memory; {hint} "
                          "(LLMOPT_MEMORY_CHECK=0 skips this check)")
    log.info("%s %s", what, plan.describe())
    return plan
