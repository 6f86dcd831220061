"""Streaming quantization: one decoder layer in memory at a time.

    plan the output tensors (names, dtypes, shapes from the config) -> embeddings (written,
    and the calibration tokens' rows gathered) -> per layer: read its tensors (pread, no
    mmap), build the same layer the loader builds, calibrate + quantize it
    (`layerwise.quantize_decoder_layer`), write its tensors, free it -> final norm -> lm_head

Peak memory is one layer in the compute dtype plus the calibration activations (the
residual stream [samples x seq_len, hidden] and one layer's intermediates), not the model.
The layer is built exactly as `loader.build_model` builds it (stacked q/k/v and gate/up,
the kernel backend's ops for the compute dtype), so the result equals quantizing the fully
loaded model layer by layer, bit for bit. The linears are not `prepare`d for the backend's
inference kernels: the quantizer rewrites their weights during the forward, and a
pre-packed copy (oneDNN, for very wide layers) would go stale.

GGUF export without AWQ (`--method gguf`) has nothing to calibrate: its tensors are copied
one at a time (the embedding table and output projection in row chunks) to the GGUF file
writer, which quantizes each to its GGUF type as it arrives.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from llmopt.core.compressed_tensors import fp8_shapes, fp8_tensors
from llmopt.core.config import ModelConfig
from llmopt.core.fp8_weight import Fp8Weight
from llmopt.core.memory import release_freed_memory
from llmopt.core.quant_formats import pack_tensors, packed_shapes
from llmopt.core.quantized_weight import QuantizedWeight
from llmopt.core.threads import one_thread
from llmopt.core.weights import CheckpointReader, TensorSpec
from llmopt.errors import LlmoptError
from llmopt.model.attention import EqualLengthAttention
from llmopt.model.backends import KernelBackend, select_backend
from llmopt.model.linear import DenseLinear, make_linear
from llmopt.model.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM, RMSNorm, checkpoint_names
from llmopt.model.rope import RotaryEmbedding
from llmopt.quant.layerwise import (MethodOptions, QuantizedSite, checkpoint_tensors, part_slice,
                                    quantize_decoder_layer, quantize_output_layer, site_of, sites_of)

EMBED = "model.embed_tokens.weight"
ROWS_PER_CHUNK = 8192  # embedding / vocabulary rows read and written at a time


class TensorSink(Protocol):
    """Where output tensors go: a safetensors checkpoint writer, a GGUF file writer, or a collector."""

    def write(self, name: str, tensor: torch.Tensor, row_start: int = 0) -> None: ...


@dataclass
class SiteReport:
    """What the report keeps of a quantized site once its tensors are written: not its codes,
    which over an 8B model's layers add up to gigabytes."""

    name: str
    relative_error: float | None
    details: dict

    @classmethod
    def of(cls, site: QuantizedSite) -> "SiteReport":
        return cls(site.name, site.relative_error, site.details)


@dataclass
class StreamedQuantization:
    sites: list[SiteReport]
    layer_seconds: list[float] = field(default_factory=list)
    layer_cpu_seconds: list[float] = field(default_factory=list)  # the process's CPU time (all threads)


def output_plan(config: ModelConfig, fmt: str, options: MethodOptions | None, quantize_lm_head: bool) -> list[TensorSpec]:
    """Every tensor of the output, in model order: packed int4 tensors (FP8 ones for method
    fp8) for the quantized projections (fp16 for the rest) in the AWQ/GPTQ/compressed-tensors
    formats; float32 tensors for GGUF (AWQ's
    scaled weights unrounded: GGUF's types do the rounding)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    quantized = set()
    if options is not None and fmt != "gguf":
        quantized = {site for i in range(config.num_hidden_layers) for site in sites_of(f"model.layers.{i}")}
        if quantize_lm_head:
            quantized.add("lm_head")
    dense_dtype = torch.float32 if fmt == "gguf" else torch.float16
    plan = []
    for name, tensor in checkpoint_tensors(config, model).items():
        if name == "lm_head.weight" and config.tie_word_embeddings and not (quantize_lm_head and options):
            continue  # tied: the embeddings serve as the output projection
        site = site_of(name)
        if name.endswith(".weight") and site in quantized:
            out_features, in_features = tensor.shape
            prefix = name[: -len(".weight")]
            if options.method == "fp8":
                shapes = fp8_shapes(prefix, out_features, in_features,
                                    "channel" if options.fp8_scheme == "FP8_DYNAMIC" else "tensor", options.calibrated)
            else:
                shapes = packed_shapes(fmt, prefix, out_features, in_features, options.scheme)
            plan.extend(TensorSpec(n, dtype, shape) for n, (dtype, shape) in shapes.items())
        else:
            plan.append(TensorSpec(name, dense_dtype, tuple(tensor.shape)))
    return plan


def stream_quantize(reader: CheckpointReader, config: ModelConfig, input_ids: torch.Tensor | None,
                    options: MethodOptions | None, fmt: str, sink: TensorSink, quantize_lm_head: bool = False,
                    dtype: torch.dtype = torch.float32, device: torch.device = torch.device("cpu"),
                    on_layer: Callable[[int, int], None] | None = None) -> StreamedQuantization:
    """Quantize the checkpoint `reader` reads layer by layer into `sink` (its tensors as
    `output_plan` lists them). `options` None copies the weights unquantized, one tensor at a
    time and in `dense_dtype` straight from the checkpoint's (GGUF's own types quantize them;
    there is no forward, so `dtype` plays no part); `input_ids` [samples, seq_len] calibrate
    AWQ/GPTQ and FP8's static activation scales."""
    _check_present(reader, config, quantize_lm_head)
    # the kernel backend's ops run the calibration forward; a plain copy needs none (nor their build)
    backend = None if options is None else select_backend(device, dtype)
    ops = None if backend is None else backend.decoder_ops(dtype)
    # float32 products of the calibration in the backend's bf16 math where --fp32-matmul-precision says so;
    # never one whose result is rounded to bf16 (Hessians and scale-search losses sum thousands of them)
    matmul = None if backend is None else backend.fp32_prefill_linear(options.fp32_matmul_precision, rounded_result=False)
    dense_dtype = torch.float32 if fmt == "gguf" else torch.float16
    calibrated = options is not None and options.calibrated
    x = _embeddings(reader, sink, input_ids if calibrated else None, dtype, device, dense_dtype)
    cos = sin = attn = None
    if calibrated:
        num_seqs, seq_len = input_ids.shape
        rotary = RotaryEmbedding(config).to(device)
        cos, sin = rotary(torch.arange(seq_len).repeat(num_seqs).to(device), x.dtype)
        attn = EqualLengthAttention(num_seqs, seq_len)
    result = StreamedQuantization(sites=[])
    total = config.num_hidden_layers
    if on_layer:
        on_layer(0, total)  # the layers start now: progress and ETA count from here, not from start-up
    for i in range(total):
        start, cpu_start = time.perf_counter(), time.process_time()
        prefix = f"model.layers.{i}"
        if options is None:
            _copy_layer(reader, config, i, sink, dense_dtype)
        else:
            layer = _read_layer(reader, config, i, dtype, device, backend, matmul)
            x, sites = quantize_decoder_layer(config, layer, i, x, cos, sin, attn, options, matmul)
            _emit(sink, config, layer, prefix, sites, fmt, dense_dtype)
            result.sites.extend(SiteReport.of(site) for site in sites)
            del layer, sites
        release_freed_memory()
        result.layer_seconds.append(round(time.perf_counter() - start, 3))
        result.layer_cpu_seconds.append(round(time.process_time() - cpu_start, 3))
        if on_layer:
            on_layer(i + 1, total)
    head_source = EMBED if config.tie_word_embeddings else "lm_head.weight"
    if options is None:
        _copy_tensor(reader, "model.norm.weight", (config.hidden_size,), sink, dense_dtype)
    else:
        with torch.device("meta"):
            norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        norm.load_state_dict({"weight": reader.get("model.norm.weight").to(device=device, dtype=dtype)}, assign=True)
        norm.ops = ops
        sink.write("model.norm.weight", norm.weight.to(dense_dtype))
    if quantize_lm_head and options is not None:
        with torch.device("meta"):
            lm_head = make_linear(config.hidden_size, config.vocab_size, bias=False)
        lm_head.load_state_dict({"weight": reader.get(head_source).to(device=device, dtype=dtype)}, assign=True)
        lm_head.use_prefill_kernel(matmul)
        site = quantize_output_layer(config, norm, lm_head, x, options, matmul)
        _emit(sink, config, lm_head, "lm_head", [site], fmt, dense_dtype)
        result.sites.append(SiteReport.of(site))
    elif not config.tie_word_embeddings:
        _copy_rows(reader, head_source, "lm_head.weight", sink, dense_dtype)
    return result


def _check_present(reader: CheckpointReader, config: ModelConfig, quantize_lm_head: bool) -> None:
    """Every tensor the model needs is in the checkpoint (checked before hours of work)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    needed = {part for name, _ in model.named_parameters() for part in checkpoint_names(name)}
    if config.tie_word_embeddings:
        needed.discard("lm_head.weight")
    missing = sorted(needed - set(reader.entries))
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise LlmoptError(f"the checkpoint is missing tensor(s) {shown}")
    rows = (config.vocab_size, config.hidden_size)  # read in row chunks, so checked here
    for name in sorted(needed & {EMBED, "lm_head.weight"}):
        if reader.shape(name) != rows:
            raise LlmoptError(f"checkpoint tensor {name} has shape {reader.shape(name)}, config implies {rows}")


def _embeddings(reader: CheckpointReader, sink: TensorSink, input_ids: torch.Tensor | None,
                dtype: torch.dtype, device: torch.device, dense_dtype: torch.dtype) -> torch.Tensor | None:
    """Write the embedding table in row chunks; gather the calibration tokens' rows on the way
    (what `embed_tokens(input_ids)` gives, without the table in memory)."""
    vocab, hidden = reader.shape(EMBED)
    ids = None if input_ids is None else input_ids.reshape(-1)
    x = None if ids is None else torch.empty(ids.numel(), hidden, dtype=dtype, device=device)
    for start in range(0, vocab, ROWS_PER_CHUNK):
        rows = reader.get_rows(EMBED, start, start + ROWS_PER_CHUNK)
        sink.write(EMBED, rows.to(dense_dtype), row_start=start)
        if ids is not None:
            hit = (ids >= start) & (ids < start + rows.shape[0])
            x[hit.to(device)] = rows.to(device=device, dtype=dtype)[(ids[hit] - start).to(device)]
        del rows  # before the next chunk is read: one chunk in memory, not two
    return x


def _copy_layer(reader: CheckpointReader, config: ModelConfig, index: int, sink: TensorSink,
                dense_dtype: torch.dtype) -> None:
    """Decoder layer `index`'s checkpoint tensors, one at a time, converted to `dense_dtype`."""
    with torch.device("meta"):
        layer = DecoderLayer(config, index)
    for name, planned in checkpoint_tensors(config, layer, f"model.layers.{index}").items():
        _copy_tensor(reader, name, tuple(planned.shape), sink, dense_dtype)


def _copy_tensor(reader: CheckpointReader, name: str, shape: tuple[int, ...], sink: TensorSink,
                 dense_dtype: torch.dtype) -> None:
    if reader.shape(name) != shape:
        raise LlmoptError(f"checkpoint tensor {name} has shape {reader.shape(name)}, config implies {shape}")
    sink.write(name, reader.get(name).to(dense_dtype))


def _copy_rows(reader: CheckpointReader, source: str, name: str, sink: TensorSink, dense_dtype: torch.dtype) -> None:
    rows_total = reader.shape(source)[0]
    for start in range(0, rows_total, ROWS_PER_CHUNK):
        sink.write(name, reader.get_rows(source, start, start + ROWS_PER_CHUNK).to(dense_dtype), row_start=start)


def _read_layer(reader: CheckpointReader, config: ModelConfig, index: int, dtype: torch.dtype,
                device: torch.device, backend: KernelBackend, matmul=None) -> DecoderLayer:
    """Decoder layer `index` with its checkpoint tensors, as `loader.build_model` builds it: the
    backend's ops and linear kernels (the loaded model's, so both quantize alike); its float32
    linears run prompt-sized products through `matmul` where given."""
    ops = backend.decoder_ops(dtype)
    with torch.device("meta"):
        layer = DecoderLayer(config, index)
    prefix = f"model.layers.{index}."
    state = {}
    for local, param in layer.named_parameters():
        parts = checkpoint_names(prefix + local)
        pieces = [reader.get(part) for part in parts]
        try:
            tensor = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
        except RuntimeError:
            raise LlmoptError(f"checkpoint tensors do not fit together: "
                              f"{', '.join(f'{p} {tuple(t.shape)}' for p, t in zip(parts, pieces))}") from None
        if tensor.shape != param.shape:
            raise LlmoptError(f"checkpoint tensor {', '.join(parts)} has shape {tuple(tensor.shape)}, "
                              f"config implies {tuple(param.shape)}")
        state[local] = tensor.to(device=device, dtype=dtype, copy=len(pieces) == 1)
        del pieces, tensor
    layer.load_state_dict(state, strict=True, assign=True)
    for module in layer.modules():
        if isinstance(module, (RMSNorm, Attention, MLP)):
            module.ops = ops
        elif isinstance(module, DenseLinear):
            module.prepare(backend)
            module.use_prefill_kernel(matmul)
    return layer.eval()


def _emit(sink: TensorSink, config: ModelConfig, module: torch.nn.Module, prefix: str, sites: list[QuantizedSite],
          fmt: str, dense_dtype: torch.dtype) -> None:
    """A module's output tensors: packed int4 for its quantized sites (AWQ's unrounded weights
    for GGUF), the rest in `dense_dtype`; fused projections split back into the checkpoint's."""
    by_site = {site.name: site for site in sites}
    for name, tensor in checkpoint_tensors(config, module, prefix).items():
        site = by_site.get(site_of(name)) if name.endswith(".weight") else None
        if site is None:
            sink.write(name, tensor.to(dense_dtype))
        elif fmt == "gguf":
            sink.write(name, site.unrounded[part_slice(config, name)].to(dense_dtype))
        elif isinstance(site.weight, Fp8Weight):
            for fp8_name, fp8_tensor in fp8_tensors(name[: -len(".weight")],
                                                    site.weight.rows(part_slice(config, name))).items():
                sink.write(fp8_name, fp8_tensor)
        else:
            q = site.weight
            rows = part_slice(config, name)
            part = QuantizedWeight(codes=q.codes[rows], scales=q.scales[rows], zeros=q.zeros[rows], g_idx=q.g_idx,
                                   scheme=q.scheme)
            with one_thread():  # packing is integer shuffling: see threads.py
                packed = pack_tensors(fmt, name[: -len(".weight")], part)
            for packed_name, packed_tensor in packed.items():
                sink.write(packed_name, packed_tensor)
