"""`llmopt plan`: what fits where, before renting anything.

For a model's architecture (a shipped config, a local model or GGUF, or a hub id whose
config.json can be fetched alone): its weights in every storage format (formats.py), its K/V
per token and per sequence at the context, and for each GPU of the table (hardware.py): how
many GPUs each format needs (tensor parallel 1/2/4/8) at `concurrency` sequences of `context`
tokens, the largest concurrency that fits, and the decode roofline — bytes one decode step
reads (weights + K/V at half the context, the mean over a generation) over the GPUs' memory
bandwidth — as tokens/s and $ per million output tokens. These are upper bounds: engines reach
40-80% of the roofline (`llmopt bench latency` measures it on the machine at hand).

Per GPU, memory usable by the engine is `gpu_memory_utilization` of it less a fixed overhead
for the CUDA context, activations and allocator slack (OVERHEAD_GIB, about what vLLM's
profiling run leaves for a 7-8B model).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from llmopt.core.config import ModelConfig
from llmopt.errors import LlmoptError
from llmopt.plan.formats import FORMATS, kv_bytes, kv_bytes_per_token, parameter_counts, weight_bytes
from llmopt.plan.hardware import Gpu

OVERHEAD_GIB = 1.5
TENSOR_PARALLEL = (1, 2, 4, 8)
GIB = 2**30


@dataclass
class PlanRequest:
    context: int = 4096
    concurrency: int = 16
    gpu: str = "H100-SXM"
    kv_dtype_bytes: int = 2
    gpu_memory_utilization: float = 0.9
    requests_per_hour: float | None = None
    output_tokens_per_request: int = 256
    formats: list[str] = field(default_factory=lambda: list(FORMATS))


@dataclass
class Placement:
    """One format on one GPU type."""

    format: str
    gpu: str
    weights_gib: float
    gpus_needed: int | None  # None: more than 8
    max_concurrency: int  # sequences of `context` tokens that fit on gpus_needed (or 1) GPUs
    roofline_tok_s_batch1: float
    roofline_tok_s: float  # all `concurrency` sequences together (0 when they do not fit)
    usd_per_million_tokens: float | None


def config_of(spec: str) -> ModelConfig:
    """The architecture of `spec`, downloading nothing but a hub id's config.json."""
    from llmopt.core.architectures import SHIPPED, shipped_config

    shipped = shipped_config(spec)
    if shipped is not None:
        return shipped
    path = Path(spec)
    if spec == "default" or path.exists():
        from llmopt.core import resolve

        return resolve(spec).config
    if spec.count("/") == 1 and not spec.startswith((".", "/")):
        try:
            from huggingface_hub import hf_hub_download

            return ModelConfig.from_file(Path(hf_hub_download(spec, "config.json")))
        except LlmoptError:
            raise
        except Exception as exc:
            raise LlmoptError(f"cannot get {spec}'s config.json ({type(exc).__name__}); give a shipped "
                              f"architecture ({', '.join(SHIPPED)}) or a local folder") from None
    raise LlmoptError(f"unknown model {spec!r}: give a shipped architecture ({', '.join(SHIPPED)}), "
                      "'default', a local folder or .gguf file, or a hub id like org/name")


def place(cfg: ModelConfig, fmt_name: str, gpu: Gpu, req: PlanRequest) -> Placement:
    weights = weight_bytes(cfg, FORMATS[fmt_name])
    per_sequence = kv_bytes(cfg, req.context, req.kv_dtype_bytes)
    usable = gpu.memory_gib * GIB * req.gpu_memory_utilization - OVERHEAD_GIB * GIB
    needed = next((n for n in TENSOR_PARALLEL if n * usable >= weights + req.concurrency * per_sequence), None)
    n = needed or 1
    max_concurrency = max(0, math.floor((n * usable - weights) / per_sequence)) if per_sequence else 0
    mean_kv = kv_bytes(cfg, max(1, req.context // 2), req.kv_dtype_bytes)
    bandwidth = n * gpu.bandwidth_gb_s * 1e9
    batch1 = bandwidth / (weights + mean_kv)
    aggregate = req.concurrency * bandwidth / (weights + req.concurrency * mean_kv) if needed else 0.0
    usd = n * gpu.usd_per_hour / (aggregate * 3600) * 1e6 if aggregate else None
    return Placement(fmt_name, gpu.name, weights / GIB, needed, max_concurrency, batch1, aggregate, usd)


def make_plan(spec: str, cfg: ModelConfig, gpus: dict[str, Gpu], req: PlanRequest) -> dict[str, Any]:
    if req.gpu not in gpus:
        raise LlmoptError(f"unknown GPU {req.gpu!r}; known: {', '.join(gpus)} (add one with --prices FILE)")
    if req.context < 1 or req.concurrency < 1:
        raise LlmoptError("--context and --concurrency must be at least 1")
    if not 0 < req.gpu_memory_utilization <= 1:
        raise LlmoptError(f"--gpu-memory-utilization must be in (0, 1], got {req.gpu_memory_utilization}")
    if (req.requests_per_hour is not None and req.requests_per_hour < 0) or req.output_tokens_per_request < 1:
        raise LlmoptError("--requests-per-hour must be 0 or more and --output-tokens at least 1")
    unknown = [f for f in req.formats if f not in FORMATS]
    if unknown:
        raise LlmoptError(f"unknown format {unknown[0]!r}; known: {', '.join(FORMATS)}")
    if req.context > cfg.max_position_embeddings:
        raise LlmoptError(f"--context {req.context} exceeds the model's {cfg.max_position_embeddings} positions")
    gpu = gpus[req.gpu]
    formats = [place(cfg, f, gpu, req) for f in req.formats]
    compared = [f for f in ("bf16", "awq-int4-g128") if f in req.formats]
    per_gpu = [place(cfg, f, g, req) for g in gpus.values() for f in compared]
    counts = parameter_counts(cfg)
    return {
        "model": spec,
        "architecture": {"model_type": cfg.model_type, "parameters": cfg.num_parameters,
                         "layers": cfg.num_hidden_layers, "kv_heads": cfg.num_key_value_heads,
                         "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
                         "sliding_window": next((w for w in cfg.sliding_windows if w), None),
                         "max_position_embeddings": cfg.max_position_embeddings,
                         "tied_embeddings": counts.output == 0},
        "request": asdict(req) | {"formats": req.formats},
        "kv_bytes_per_token": kv_bytes_per_token(cfg, req.kv_dtype_bytes),
        "kv_gib_per_sequence": kv_bytes(cfg, req.context, req.kv_dtype_bytes) / GIB,
        "overhead_gib_per_gpu": OVERHEAD_GIB,
        "formats": [asdict(p) | {"exact": FORMATS[p.format].exact} for p in formats],
        "gpus": [asdict(p) | {"memory_gib": gpus[p.gpu].memory_gib, "bandwidth_gb_s": gpus[p.gpu].bandwidth_gb_s,
                              "usd_per_hour": gpus[p.gpu].usd_per_hour} for p in per_gpu],
        "recommendations": recommend(cfg, gpu, req, {p.format: p for p in formats}),
    }


def recommend(cfg: ModelConfig, gpu: Gpu, req: PlanRequest, by_format: dict[str, Placement]) -> list[dict[str, str]]:
    """The seeds' deployment rules, applied to these figures: [{"advice", "reason"}]."""
    out: list[dict[str, str]] = []
    half, int4 = by_format.get("bf16"), by_format.get("awq-int4-g128")
    where = f"{req.concurrency} sequences of {req.context} tokens on {gpu.name}"
    if half and int4:
        if half.gpus_needed != 1 and int4.gpus_needed == 1:
            out.append({"advice": "quantize to AWQ int4",
                        "reason": f"bf16 needs {half.gpus_needed or 'more than 8'} GPUs for {where}; int4 "
                                  f"({int4.weights_gib:.1f} GiB) fits on one"})
        elif half.gpus_needed == 1:
            out.append({"advice": "bf16 fits; AWQ int4 for speed and cost",
                        "reason": f"a decode step reads {half.weights_gib:.1f} GiB of bf16 weights vs "
                                  f"{int4.weights_gib:.1f} GiB in int4: roofline {half.roofline_tok_s_batch1:.0f} vs "
                                  f"{int4.roofline_tok_s_batch1:.0f} tok/s at batch 1"})
        elif int4.gpus_needed is None:
            out.append({"advice": "use more or larger GPUs, a shorter context or lower concurrency",
                        "reason": f"even int4 does not fit {where} on 8 GPUs"})
        else:
            out.append({"advice": f"AWQ int4 on {int4.gpus_needed} GPUs (tensor parallel)",
                        "reason": f"bf16 needs {half.gpus_needed or 'more than 8'} GPUs for {where}"})
    q4km = by_format.get("gguf-Q4_K_M")
    if q4km:
        out.append({"advice": f"on a CPU or a Mac: GGUF Q4_K_M (~{q4km.weights_gib:.1f} GiB) with llama.cpp",
                    "reason": "llama.cpp's kernels run K-quants on CPUs and Apple GPUs; vLLM needs a CUDA/ROCm GPU"})
    chosen = int4 if int4 and int4.gpus_needed == 1 else half
    if chosen and chosen.gpus_needed:
        spare = chosen.max_concurrency - req.concurrency
        if req.concurrency <= 4 and spare > req.concurrency:
            out.append({"advice": "try speculative decoding (a draft 10-20x smaller, 4-5 tokens per step)",
                        "reason": f"at {req.concurrency} sequences decode is bandwidth-bound (roofline "
                                  f"{chosen.roofline_tok_s_batch1:.0f} tok/s per sequence) and memory is spare; it "
                                  "pays only while acceptance stays above ~0.5 tokens per step, which no engine "
                                  "checks at start-up: measure it"})
        else:
            out.append({"advice": "skip speculative decoding",
                        "reason": f"at {req.concurrency} concurrent sequences the batch already uses the "
                                  "bandwidth a draft would exploit" if req.concurrency > 4 else
                                  "the K/V of more sequences leaves no room for a draft model"})
    out.append({"advice": "keep prefix caching on (the default in llmopt and vLLM)",
                "reason": "requests that share a system prompt skip its prefill, and its K/V is stored once"})
    if req.requests_per_hour is not None and chosen and chosen.roofline_tok_s:
        # engines reach about half the roofline under load (bench latency's MBU)
        busy = req.requests_per_hour * req.output_tokens_per_request / (0.5 * chosen.roofline_tok_s * 3600)
        if busy < 0.15:
            advice, reason = "serverless (scale to zero)", "busy"
        elif busy > 0.5:
            advice, reason = "an always-on GPU", "busy"
        else:
            advice, reason = "either; always-on if cold starts matter", "busy"
        out.append({"advice": advice,
                    "reason": f"{req.requests_per_hour:g} requests/h x {req.output_tokens_per_request} tokens keep "
                              f"one {chosen.format} deployment {reason} {busy:.0%} of the hour (at half its "
                              f"roofline); loading {chosen.weights_gib:.1f} GiB of weights is the cold start"})
    return out
