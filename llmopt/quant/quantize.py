"""`quantize(...)`: one model in, one quantized checkpoint (folder or .gguf) and a report out.

    memory plan (refuse early) -> calibration tokens -> layer by layer from the checkpoint on
    disk: read, calibrate, RTN / AWQ / GPTQ / FP8, pack, write (streaming.py; temp path, renamed at
    the end) -> quantize_report.json

Only one decoder layer is in memory at a time, in the compute dtype (`--dtype`); its
quantized weights are split back into the checkpoint's per-projection tensors, packed and
written to the planned shards before the next layer is read. GGUF export plans the file's
header and tensor infos from the config first, then quantizes each tensor to its GGUF type
as it arrives (gguf_export.py).
"""

from __future__ import annotations

import gc
import json
import logging
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from llmopt import __version__
from llmopt.core import resolve
from llmopt.core.atomic import atomic_dir, atomic_file
from llmopt.core.config import ModelConfig
from llmopt.core.convert import DTYPES, write_hf_files
from llmopt.core.device import DEVICE_HELP, resolve_device
from llmopt.core.memory import release_freed_memory
from llmopt.core.compressed_tensors import FP8_SCHEMES, fp8_config
from llmopt.core.quant_formats import quantization_config
from llmopt.core.source import load_tokenizer
from llmopt.core.weights import DEFAULT_MAX_SHARD_SIZE, CheckpointReader, SafetensorsShardWriter, parse_shard_size
from llmopt.core.output_paths import check_output
from llmopt.errors import LlmoptError
from llmopt.kernels.cpu_linear import FP32_MATMUL_PRECISIONS
from llmopt.loader import load
from llmopt.model.backends import select_backend
from llmopt.options import option
from llmopt.quant.calibration import CalibrationData, TextModel, load_calibration
from llmopt.quant.layerwise import MethodOptions, checkpoint_tensors
from llmopt.quant.memory_plan import check_fits, quantize_plan
from llmopt.quant.quantizer import QuantScheme
from llmopt.quant.streaming import output_plan, stream_quantize

log = logging.getLogger("llmopt")

METHODS = ("rtn", "awq", "gptq", "fp8", "gguf")
FORMATS = ("awq", "gptq", "compressed-tensors", "gguf")
DEFAULT_FORMAT = {"rtn": "gptq", "awq": "awq", "gptq": "gptq", "fp8": "compressed-tensors", "gguf": "gguf"}
REPORT_NAME = "quantize_report.json"


@dataclass
class QuantizeRequest:
    """`llmopt quantize`'s options (and a recipe's `quantize` section: `llmopt.options`)."""

    model: str = option(help="'default', a model folder, or a hub id (unquantized)", argument=True, recipe=None)
    output: Path = option(help="Folder to write (AWQ/GPTQ) or a .gguf file.", names=("--output", "-o"),
                          recipe=None)
    method: str = option("awq", "rtn, awq, gptq, fp8 or gguf", choices=METHODS, recipe_required=True)
    format: Optional[str] = option(None, "awq, gptq, compressed-tensors or gguf (default: awq for awq, "
                                   "compressed-tensors for fp8, gguf for gguf, else gptq)", choices=FORMATS)
    fp8_scheme: str = option("FP8_DYNAMIC", "--method fp8, llm-compressor's schemes: FP8_DYNAMIC (a weight scale per "
                             "output channel, activations scaled per token at run time) or FP8 (per-tensor weight "
                             "scales, a static activation scale calibrated on --calib)", names=("--scheme",),
                             choices=FP8_SCHEMES, recipe="scheme")
    bits: int = option(4, "Weight bits (the AWQ/GPTQ writers pack 4).", ge=1)
    group_size: int = option(64, "Input channels per scale/zero group; -1 = per channel.")
    # defaults measured on the embedded model (docs/benchmarks.md): asymmetric grids, and for
    # GPTQ act-order with 10% damping, gave the lowest KL divergence to the unquantized model
    sym: bool = option(False, "Symmetric grid (vLLM's Marlin GPTQ kernels want --sym; --asym measured better here).",
                       names=("--sym/--asym",))
    desc_act: Optional[bool] = option(None, "GPTQ act-order: quantize high-activation columns first "
                                      "(default: on for gptq).")
    damp_percent: float = option(0.1, "GPTQ Hessian damping, a fraction of its mean diagonal (raised on failure).")
    calib: str = option("self", "self (model-generated), a .txt/.jsonl/.parquet file, or hf:NAME[:CONFIG][:SPLIT]",
                        recipe="calibration.source")
    num_samples: int = option(64, "Calibration samples.", recipe="calibration.num_samples", ge=1)
    seq_len: int = option(256, "Tokens per calibration sample.", recipe="calibration.seq_len", ge=1)
    seed: int = option(0, "Calibration sampling seed.", recipe="calibration.seed", ge=0)
    gguf_type: str = option("Q4_K_M", "F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K_M, Q5_K_M, Q6_K")
    quantize_lm_head: bool = option(False, "Quantize the output projection too.", names=("--quantize-lm-head",))
    overwrite: bool = option(False, "Replace OUTPUT if it exists.", names=("--overwrite",), recipe=None)
    device: str = option("auto", DEVICE_HELP)
    dtype: str = option("float32", "Compute dtype of the calibration forward: float32, bfloat16 or float16 "
                        "(bfloat16 halves the layer and activation memory; float32 follows the model's math exactly).",
                        choices=tuple(DTYPES))
    fp32_matmul_precision: str = option(
        "auto", "What the calibration's large float32 products compute in (the forward's linears, AWQ's scale "
        "search, GPTQ's Hessian): ieee (float32); bf16 (bfloat16 inputs, float32 sums on AMX tiles, several "
        "times the float32 rate); auto: bf16 where the CPU has AMX-BF16, else ieee "
        "(CPUs with AVX512-BF16 alone round bf16 products' results, which calibration does not take).", choices=FP32_MATMUL_PRECISIONS)
    max_shard_size: str = option(DEFAULT_MAX_SHARD_SIZE, "Largest safetensors file (e.g. 5GB, 500MB): a larger "
                                 "checkpoint is split into shards with model.safetensors.index.json, as transformers does.")

    def resolved_format(self) -> str:
        return self.format or DEFAULT_FORMAT[self.method]

    def scheme(self) -> QuantScheme:
        return QuantScheme(bits=self.bits, group_size=self.group_size, sym=self.sym)

    def resolved_desc_act(self) -> bool:
        # compressed-tensors 0.20 has no field for permuted groups (its actorder "group" was removed)
        default = self.method == "gptq" and self.resolved_format() != "compressed-tensors"
        return default if self.desc_act is None else self.desc_act

    def calibrated(self) -> bool:
        """Whether the method needs calibration samples: AWQ, GPTQ, FP8's static activation scales."""
        return self.method in ("awq", "gptq") or (self.method == "fp8" and self.fp8_scheme == "FP8")


@dataclass
class QuantizeReport:
    output: str
    method: str
    format: str
    parameters: dict[str, Any]
    calibration: dict[str, Any] | None
    seed: int
    wall_seconds: float
    calibration_seconds: float
    quantize_seconds: float
    peak_rss_bytes: int
    size_before_bytes: int
    size_after_bytes: int
    layers: list[dict[str, Any]] = field(default_factory=list)
    layer_seconds: list[float] = field(default_factory=list)  # wall time of each decoder layer, in order
    # the process's CPU time per layer (all threads): on a shared machine a steadier measure than wall time
    layer_cpu_seconds: list[float] = field(default_factory=list)
    memory_plan: dict[str, Any] = field(default_factory=dict)  # the RAM estimated before the run (memory_plan.py)
    mean_relative_error: float | None = None
    source: str = ""
    llmopt_version: str = __version__

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def validate(req: QuantizeRequest) -> None:
    """Everything checkable before loading a model: bad flags fail in milliseconds."""
    if req.method not in METHODS:
        raise LlmoptError(f"unknown method {req.method!r}; choose one of: {', '.join(METHODS)}")
    fmt = req.resolved_format()
    if fmt not in FORMATS:
        raise LlmoptError(f"unknown format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    if req.method == "gguf" and fmt != "gguf":
        raise LlmoptError("--method gguf writes a .gguf file; drop --format or use --format gguf")
    if req.method == "fp8" and fmt != "compressed-tensors":
        raise LlmoptError("--method fp8 writes the compressed-tensors format; drop --format or use "
                          "--format compressed-tensors")
    if req.fp8_scheme not in FP8_SCHEMES:
        raise LlmoptError(f"unknown --scheme {req.fp8_scheme!r}; choose one of: {', '.join(FP8_SCHEMES)}")
    if fmt == "gguf":
        from llmopt.quant.gguf_export import GGUF_TYPES

        if req.gguf_type not in GGUF_TYPES:
            raise LlmoptError(f"unknown GGUF type {req.gguf_type!r}; choose one of: {', '.join(GGUF_TYPES)}")
        if req.method in ("rtn", "gptq"):
            raise LlmoptError(f"--method {req.method} --format gguf is not supported: GGUF types carry their own "
                              "rounding; use --method gguf, or --method awq --format gguf for AWQ-scaled weights")
        if req.output.suffix != ".gguf":
            raise LlmoptError(f"GGUF output must be a .gguf file path, got {req.output}")
    elif req.method != "fp8":
        if req.bits != 4:
            raise LlmoptError(f"--bits {req.bits} is not supported: the {fmt.upper()} writer packs 4-bit weights only")
        if req.group_size != -1 and req.group_size not in (32, 64, 128, 256) and (req.group_size < 8 or req.group_size % 8):
            raise LlmoptError(f"--group-size must be -1 or a positive multiple of 8 (32, 64, 128 are usual), got {req.group_size}")
        if fmt == "awq" and req.group_size == -1:
            raise LlmoptError("the AWQ format needs a positive --group-size (vLLM and AutoAWQ size groups from it); "
                              "use --format gptq for per-channel (-1) groups")
        if fmt in ("awq", "compressed-tensors") and req.resolved_desc_act():
            raise LlmoptError("--desc-act (act-order) needs the GPTQ format's g_idx; use --format gptq")
    if req.method != "gptq" and req.desc_act:
        raise LlmoptError("--desc-act applies to --method gptq only")
    if not 0 < req.damp_percent < 1:
        raise LlmoptError(f"--damp-percent must be in (0, 1), got {req.damp_percent}")
    if req.dtype not in DTYPES:
        raise LlmoptError(f"unknown --dtype {req.dtype!r}; choose one of: {', '.join(DTYPES)}")
    if req.fp32_matmul_precision not in FP32_MATMUL_PRECISIONS:
        raise LlmoptError(f"unknown --fp32-matmul-precision {req.fp32_matmul_precision!r}; choose one of: "
                          f"{', '.join(FP32_MATMUL_PRECISIONS)}")
    parse_shard_size(req.max_shard_size)
    check_output(req.output, req.overwrite)  # new or llmopt's own, and writable: found out before the work


def check_shapes(config: ModelConfig, group_size: int, quantize_lm_head: bool) -> None:
    """Every quantized layer's input size must split into whole groups (say which sizes would
    work), and int4 packing needs sizes divisible by 8."""
    cfg = config
    if quantize_lm_head and cfg.vocab_size % 8:
        raise LlmoptError(f"--quantize-lm-head: the vocabulary size {cfg.vocab_size} is not a multiple of 8, "
                          "which int4 packing needs; leave the output projection unquantized")
    if group_size == -1:
        return
    inputs = {"q/k/v, gate/up (hidden_size)": cfg.hidden_size, "o_proj": cfg.num_attention_heads * cfg.head_dim,
              "down_proj (intermediate_size)": cfg.intermediate_size}
    for name, size in inputs.items():
        if size % group_size:
            sizes = [g for g in (32, 64, 128, 256) if all(s % g == 0 for s in inputs.values())]
            raise LlmoptError(
                f"--group-size {group_size} does not divide the input size {size} of {name}; "
                f"sizes that divide every layer: {', '.join(map(str, sizes)) or 'none of 32/64/128/256'} (or -1)"
            )


def quantize(req: QuantizeRequest, on_layer: Callable[[int, int], None] | None = None) -> QuantizeReport:
    """Quantize layer by layer from the checkpoint on disk (`streaming.py`): one decoder layer
    in memory at a time, after a memory plan that refuses early what cannot fit."""
    start = time.perf_counter()
    validate(req)
    source = resolve(req.model)
    if source.quantization is not None and (source.quantization.method in ("awq", "gptq", "compressed-tensors")
                                            or source.kind == "gguf"):
        what = source.quantization.details.get("file_type") or source.quantization.method.upper()
        raise LlmoptError(f"{req.model} is already quantized ({what}); quantize from an unquantized model")
    config, fmt, scheme = source.config, req.resolved_format(), req.scheme()
    dtype, device = DTYPES[req.dtype], resolve_device(req.device)
    if req.method not in ("gguf", "fp8"):
        check_shapes(config, req.group_size, req.quantize_lm_head)
    calibrated = req.calibrated()
    reader = CheckpointReader.from_folder(source.path)  # headers only: a bad file fails here, in milliseconds
    tokenizer = load_tokenizer(source)
    tokenizer.extra_eos_token_ids = sorted(set(tokenizer.extra_eos_token_ids) | set(config.eos_token_ids))
    calib, calib_seconds, t0 = None, 0.0, time.perf_counter()
    if calibrated and req.calib != "self":  # text: tokenized before the plan, so a bad file fails first
        calib = load_calibration(req.calib, TextModel(config=config, tokenizer=tokenizer),
                                 req.num_samples, req.seq_len, req.seed)
    calib_seconds = time.perf_counter() - t0
    self_hint = ", or pass a calibration text with --calib (--calib self loads the whole model)"
    memory = check_fits(
        quantize_plan(config, req.method, fmt, req.num_samples, req.seq_len, dtype,
                      calib_self=req.calib == "self", quantize_lm_head=req.quantize_lm_head,
                      gguf_type=req.gguf_type if fmt == "gguf" else None, calibrated=calibrated),
        f"quantize --method {req.method}",
        _memory_hint(req) + (self_hint if calibrated and req.calib == "self" else ""))
    if calibrated and calib is None:
        t0 = time.perf_counter()
        calib = _self_calibration(req, source)
        calib_seconds = time.perf_counter() - t0
    calib_info, input_ids = None, None
    if calib is not None:
        calib_info = {"source": calib.source, "num_samples": req.num_samples, "seq_len": req.seq_len,
                      "documents": calib.num_documents, "tokens_available": calib.num_tokens_available}
        input_ids = calib.input_ids.to(device)

    t_quant = time.perf_counter()
    options = None if req.method == "gguf" else MethodOptions(
        method=req.method, scheme=scheme, desc_act=req.resolved_desc_act(), damp_percent=req.damp_percent,
        keep_unrounded=fmt == "gguf", fp8_scheme=req.fp8_scheme, fp32_matmul_precision=req.fp32_matmul_precision)
    plan = output_plan(config, fmt, options, req.quantize_lm_head)
    untied = req.quantize_lm_head and options is not None and config.tie_word_embeddings
    stream = dict(quantize_lm_head=req.quantize_lm_head, dtype=dtype, device=device, on_layer=on_layer)
    if fmt == "gguf":
        from llmopt.quant.gguf_export import gguf_file

        # the file's layout is planned from the config, then each tensor is quantized as it arrives
        with gguf_file(req.output, _output_config(source.raw_config, None, untied),
                       {spec.name: spec.shape for spec in plan}, tokenizer, req.gguf_type,
                       overwrite=req.overwrite, metadata={"llmopt.method": req.method}) as writer:
            streamed = stream_quantize(reader, config, input_ids, options, fmt, writer, **stream)
        quant_seconds = time.perf_counter() - t_quant
        size_after = req.output.stat().st_size
    else:
        qconfig = fp8_config(req.fp8_scheme, req.quantize_lm_head) if req.method == "fp8" else \
            quantization_config(fmt, scheme, req.resolved_desc_act(), lm_head=req.quantize_lm_head,
                                damp_percent=req.damp_percent)
        with atomic_dir(req.output, overwrite=req.overwrite) as tmp:
            writer = SafetensorsShardWriter(tmp, plan, req.max_shard_size)
            streamed = stream_quantize(reader, config, input_ids, options, fmt, writer, **stream)
            writer.close()
            write_hf_files(tmp, _output_config(source.raw_config, qconfig, untied), tokenizer,
                           {"quantized_from": source.origin or str(source.path), "method": req.method})
        quant_seconds = time.perf_counter() - t_quant
        size_after = sum(f.stat().st_size for f in req.output.glob("*.safetensors"))

    sites = streamed.sites
    errors = [s.relative_error for s in sites if s.relative_error is not None]
    report = QuantizeReport(
        output=str(req.output), method=req.method, format=fmt,
        parameters={"bits": (8 if req.method == "fp8" else scheme.bits) if fmt != "gguf" else None,
                    "group_size": scheme.group_size if fmt != "gguf" and req.method != "fp8" else None,
                    "sym": scheme.sym if fmt != "gguf" and req.method != "fp8" else None,
                    "scheme": req.fp8_scheme if req.method == "fp8" else None, "desc_act": req.resolved_desc_act(),
                    "damp_percent": req.damp_percent if req.method == "gptq" else None,
                    "gguf_type": req.gguf_type if fmt == "gguf" else None, "quantize_lm_head": req.quantize_lm_head,
                    "device": str(device), "dtype": req.dtype,
                    "fp32_matmul": _fp32_matmul(req, dtype, device) if calibrated else None},
        calibration=calib_info, seed=req.seed, wall_seconds=round(time.perf_counter() - start, 3),
        calibration_seconds=round(calib_seconds, 3), quantize_seconds=round(quant_seconds, 3),
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        size_before_bytes=_source_size(source), size_after_bytes=size_after,
        layers=[{"name": s.name, "relative_error": s.relative_error, **s.details} for s in sites],
        layer_seconds=streamed.layer_seconds, layer_cpu_seconds=streamed.layer_cpu_seconds,
        memory_plan=memory.to_dict(),
        mean_relative_error=sum(errors) / len(errors) if errors else None,
        source=source.origin or str(source.path),
    )
    report_path = req.output / REPORT_NAME if req.output.is_dir() else req.output.with_name(req.output.name + ".quantize_report.json")
    with atomic_file(report_path) as tmp:
        tmp.write_text(json.dumps(report.to_dict(), indent=2), encoding="utf-8")
    return report


def _fp32_matmul(req: QuantizeRequest, dtype: torch.dtype, device: torch.device) -> str:
    """What the calibration's float32 products computed in: "bf16" or "ieee" (`--fp32-matmul-precision`
    resolved on this machine)."""
    kernel = select_backend(device, dtype).fp32_prefill_linear(req.fp32_matmul_precision, rounded_result=False)
    return "ieee" if kernel is None else "bf16"


def _memory_hint(req: QuantizeRequest) -> str:
    if req.method != "gguf":
        return "lower --num-samples/--seq-len or use --dtype bfloat16"
    from llmopt.quant.gguf_export import K_QUANT_TYPES

    if req.gguf_type in K_QUANT_TYPES:  # llama.cpp's phase dominates: see memory_plan.py
        return f"{req.gguf_type} is quantized by llama.cpp, which holds the largest tensor in float32 twice; " \
               "a type quantized as it streams (Q8_0, Q5_1, Q4_0, ...) needs less"
    return "the export holds one tensor at a time; free some memory"


def _self_calibration(req: QuantizeRequest, source) -> CalibrationData:
    """`--calib self`: the model writes its calibration text, so it is loaded whole for that
    (and freed before the layers stream)."""
    loaded = load(source, dtype="float32", device=str(resolve_device(req.device)), int4_kernels=False)
    try:
        return load_calibration("self", loaded, req.num_samples, req.seq_len, req.seed)
    finally:
        del loaded
        gc.collect()
        release_freed_memory()


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """Our decoder's weights under checkpoint names: fused q/k/v and gate/up split back apart."""
    state = checkpoint_tensors(model.config, model)
    if model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight:
        state.pop("lm_head.weight", None)
    return state


def _output_config(raw: dict[str, Any], qconfig: dict[str, Any] | None, untied: bool) -> dict[str, Any]:
    config = {k: v for k, v in raw.items() if k != "quantization_config"}
    config["torch_dtype"] = "float16" if qconfig else "float32"
    if untied:
        config["tie_word_embeddings"] = False  # --quantize-lm-head unties the output projection
    if qconfig:
        config["quantization_config"] = qconfig
    return config


def _source_size(source) -> int:
    if source.kind == "gguf":
        return source.path.stat().st_size
    return sum(f.stat().st_size for f in source.path.glob("*.safetensors"))
