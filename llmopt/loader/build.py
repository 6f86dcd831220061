"""Our decoder from checkpoint tensors, read one tensor at a time: `build_model` checks each
tensor's presence and shape, puts dense ones in the compute dtype, and gives each AWQ / GPTQ /
compressed-tensors W4A16 projection to the kernel backend's int4 layer straight from its packed
tensors (`PackedQuantizedWeight`: the grid read, the codes repacked a slab of output rows at a
time into the kernel's layout on the target device; dense only where the backend has no int4
layer for it), so a 4-bit checkpoint never exists in memory as dense weights, nor as a
projection's whole code matrix. FP8 (compressed-tensors float-quantized) projections go to
the backend's FP8 layer (fp32 CPU models: the C++ kernel reading the e4m3 bytes); elsewhere they
are dequantized to the compute dtype at load, one projection at a time. Either way activations
are not quantized: the model runs FP8's rounding of the weights."""

from __future__ import annotations

from typing import Callable, Iterable, Protocol

import torch

from llmopt.core.compressed_tensors import CompressedTensorsScheme, read_fp8, read_int4_packed, read_scheme
from llmopt.core.config import ModelConfig
from llmopt.core.fp8_weight import Fp8Weight
from llmopt.core.memory import release_freed_memory
from llmopt.core.quant_formats import read_packed
from llmopt.core.quantized_weight import PackedQuantizedWeight, QuantizedWeight
from llmopt.core.quantization_info import QuantizationInfo
from llmopt.core.threads import one_thread
from llmopt.errors import LlmoptError
from llmopt.model.backends import KernelBackend, ReferenceBackend
from llmopt.model.linear import DenseLinear, LinearBase
from llmopt.model.llama import LlamaForCausalLM, checkpoint_names

_PACKED_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


class Weights(Protocol):
    """Checkpoint tensors by Hugging Face name: a dict, a `CheckpointReader`, `DummyWeights`."""

    def __contains__(self, name: str) -> bool: ...
    def __getitem__(self, name: str) -> torch.Tensor: ...
    def __iter__(self) -> Iterable[str]: ...


def build_model(
    config: ModelConfig, weights: Weights, dtype: torch.dtype, device: torch.device,
    where: str = "checkpoint", backend: KernelBackend | None = None,
    quant: QuantizationInfo | None = None, int4_kernels: bool = True,
) -> LlamaForCausalLM:
    """Our decoder holding `weights` (HF names), its ops and layers set up for kernel backend
    `backend` (default: the reference). With `quant` (AWQ / GPTQ), packed projections become the
    backend's int4 layers (`KernelBackend.int4_linear`: llmopt's C++ kernel for fp32 CPU models,
    PyTorch's CPU int4 kernel for bf16/fp16 ones, the Triton kernel on CUDA), built on `device`
    from the packed codes a slab at a time; a projection the backend cannot take, every projection when
    `int4_kernels` is False (code that rewrites weights), and everything on the reference
    backend get dense dequantized weights."""
    backend = backend or ReferenceBackend()
    # the decoder is built from the config before any tensor is matched: a layer count the checkpoint
    # cannot fill (num_hidden_layers 2**31) is refused here, not after building that many layers
    held = {name.split(".")[2] for name in weights if name.startswith("model.layers.")}
    if config.num_hidden_layers > len(held):
        raise LlmoptError(f"{where}: the config says num_hidden_layers={config.num_hidden_layers}, but the "
                          f"checkpoint holds tensors for {len(held)} layer(s)")
    grid_of = _grid_reader(weights, quant, int4_kernels, where)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    expected = {name: p.shape for name, p in model.named_parameters()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    _check_present(expected, weights, isinstance(grid_of, (_PackedReader, _CompressedTensorsReader)), where)

    state: dict[str, torch.Tensor] = {}
    swapped = 0
    for module_name, module in list(model.named_modules()):
        if not isinstance(module, LinearBase) or f"{module_name}.weight" not in expected:
            continue
        parts = [p.removesuffix(".weight") for p in checkpoint_names(f"{module_name}.weight")]
        grids = [grid_of(p) for p in parts] if grid_of is not None else []
        if not grids or any(g is None for g in grids):
            continue
        q = _joined(grids, parts, where)
        bias = None
        if f"{module_name}.bias" in expected:
            bias = _read(weights, f"{module_name}.bias", expected, dtype, device, where)
        layer = None
        if int4_kernels and isinstance(q, (QuantizedWeight, PackedQuantizedWeight)):
            with one_thread():  # unpacking slabs of int4 words: small, memory-bound ops
                layer = backend.int4_linear(q, None if bias is None else bias.cpu(), dtype, device)
        elif int4_kernels and isinstance(q, Fp8Weight):
            layer = backend.fp8_linear(q, None if bias is None else bias.cpu(), dtype)
        if layer is not None:
            parent, _, child = module_name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, layer.to(device))
            expected.pop(f"{module_name}.weight")
            expected.pop(f"{module_name}.bias", None)
            swapped += 1
        else:
            dense = q if isinstance(q, torch.Tensor) else q.dequantize()
            state[f"{module_name}.weight"] = _checked(dense, f"{module_name}.weight", parts, expected, where)\
                .to(device=device, dtype=dtype)
            if bias is not None:
                state[f"{module_name}.bias"] = bias
        del q
        release_freed_memory()  # the packed tensors read and the repacking temporaries of this projection
    # an int4 model's vocabulary projection runs on a compact copy (`DenseLinear.use_compact_copy`), so
    # its tables need not be widened: kept in a 16-bit checkpoint's dtype they take half the memory
    # (1.6 GB less for an 8B model in fp32), and the embedding's cast of a row to fp32 is exact
    compact = backend.compact_vocab_projection(dtype) if swapped else None
    vocab_tables = {"model.embed_tokens.weight", "lm_head.weight"} if compact is not None else set()
    for name in expected:
        if name not in state:
            state[name] = _read(weights, name, expected, dtype, device, where, keep_16bit=name in vocab_tables)
        release_freed_memory()
    model.load_state_dict(state, strict=False, assign=True)
    del state
    if config.tie_word_embeddings:
        model.tie_weights()
    model.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq.to(device)
    unset = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if unset:
        raise LlmoptError(f"{where}: no weights for {', '.join(unset[:3])}")
    model.use_backend(backend, dtype)
    head = model.lm_head
    on_compact = compact is not None and isinstance(head, DenseLinear) and head.use_compact_copy(compact)
    if not on_compact:  # no compact copy after all: the tables in the compute dtype
        for table in (model.model.embed_tokens, head):
            if isinstance(table, (torch.nn.Embedding, DenseLinear)) and table.weight.dtype != dtype:
                table.weight = torch.nn.Parameter(table.weight.to(dtype), requires_grad=False)
        if config.tie_word_embeddings and isinstance(head, DenseLinear):
            model.tie_weights()
    for module in model.modules():
        if isinstance(module, DenseLinear) and not (module is head and on_compact):
            module.prepare(backend)
    release_freed_memory()
    return model.eval()


def _read(weights: Weights, name: str, expected: dict, dtype: torch.dtype, device: torch.device,
          where: str, keep_16bit: bool = False) -> torch.Tensor:
    """One parameter of our model from its checkpoint tensor(s), checked and converted (kept in
    the checkpoint's bf16 / fp16 with `keep_16bit`); a private copy even when no conversion is
    needed (a view of a memory-mapped file keeps every page of the file read so far resident)."""
    parts = checkpoint_names(name)
    if len(parts) == 1:
        tensor = weights[parts[0]]
    else:
        tensor = _stack([weights[p] for p in parts], parts, where)
    tensor = _checked(tensor, name, parts, expected, where)
    if keep_16bit and tensor.dtype in (torch.bfloat16, torch.float16):
        dtype = tensor.dtype
    return tensor.to(device=device, dtype=dtype, copy=len(parts) == 1)


def _checked(tensor: torch.Tensor, name: str, parts: list[str], expected: dict, where: str) -> torch.Tensor:
    if tensor.shape != expected[name]:
        raise LlmoptError(
            f"{where}: tensor {', '.join(parts)} has shape {tuple(tensor.shape)}, config implies {tuple(expected[name])}"
        )
    return tensor


def _stack(tensors: list[torch.Tensor], parts: list[str], where: str) -> torch.Tensor:
    try:
        return torch.cat(tensors, dim=0)
    except RuntimeError:
        shapes = ", ".join(f"{p} {tuple(t.shape)}" for p, t in zip(parts, tensors))
        raise LlmoptError(f"{where}: tensors do not fit together: {shapes}") from None


def _check_present(expected: dict, weights: Weights, quantized: bool, where: str) -> None:
    def present(part: str) -> bool:
        return part in weights or (quantized and part.endswith(".weight")
                                   and any(f"{part.removesuffix('.weight')}.{packed}" in weights
                                           for packed in ("qweight", "weight_packed")))

    missing = [part for name in expected for part in checkpoint_names(name) if not present(part)]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise LlmoptError(f"{where} is missing tensor(s) {shown}")


class _PackedReader:
    """One AWQ / GPTQ projection at a time: its grid, its codes left packed."""

    def __init__(self, weights: Weights, quant: QuantizationInfo):
        self.weights, self.quant = weights, quant
        self.gptq_v2 = quant.details.get("checkpoint_format") == "gptq_v2"

    def __call__(self, prefix: str) -> PackedQuantizedWeight | None:
        if f"{prefix}.qweight" not in self.weights:
            return None
        tensors = {f"{prefix}.{s}": self.weights[f"{prefix}.{s}"] for s in _PACKED_SUFFIXES
                   if f"{prefix}.{s}" in self.weights}
        with one_thread():
            return read_packed(self.quant.method, tensors, prefix, int(self.quant.bits),
                               int(self.quant.group_size), self.gptq_v2)


class _CompressedTensorsReader:
    """One compressed-tensors projection at a time: FP8 codes and scales, or W4A16's grid with its
    codes left packed; None for a projection the checkpoint keeps dense (its `ignore` list)."""

    def __init__(self, weights: Weights, scheme: CompressedTensorsScheme):
        self.weights, self.scheme = weights, scheme
        self.fp8 = scheme.type == "float"

    def __call__(self, prefix: str) -> PackedQuantizedWeight | Fp8Weight | None:
        marker = f"{prefix}.weight_scale" if self.fp8 else f"{prefix}.weight_packed"
        if marker not in self.weights:
            return None
        suffixes = ("weight", "weight_scale", "input_scale") if self.fp8 else \
            ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
        tensors = {f"{prefix}.{s}": self.weights[f"{prefix}.{s}"] for s in suffixes if f"{prefix}.{s}" in self.weights}
        with one_thread():
            if self.fp8:
                return read_fp8(tensors, prefix, self.scheme)
            return read_int4_packed(tensors, prefix, self.scheme)


def _grid_reader(weights: Weights, quant: QuantizationInfo | None, int4_kernels: bool,
                 where: str) -> Callable[[str], QuantizedWeight | PackedQuantizedWeight | Fp8Weight | None] | None:
    """How to read a projection (by prefix) as an int4 grid: AWQ / GPTQ packed tensors, or a
    GGUF file's Q4_0 tensors (`GGUFTensors.quantized`, only for the kernels: their dense values
    come as cheaply from the file); None where the checkpoint holds no grids."""
    if quant is not None and quant.method == "compressed-tensors":
        scheme = read_scheme(quant.details, where)
        return _CompressedTensorsReader(weights, scheme)
    if quant is not None and quant.method in ("awq", "gptq"):
        if quant.group_size is None or quant.bits is None:
            raise LlmoptError(f"{where}: quantization_config needs 'bits' and 'group_size'")
        if not any(name.endswith(".qweight") for name in weights):
            raise LlmoptError(f"{where}: the config says {quant.method.upper()} but the checkpoint has no packed "
                              "(.qweight) tensors")
        return _PackedReader(weights, quant)
    quantized = getattr(weights, "quantized", None)
    if int4_kernels and quantized is not None:
        return lambda prefix: quantized(f"{prefix}.weight")
    return None


def _joined(qs: list, parts: list[str],
            where: str) -> QuantizedWeight | PackedQuantizedWeight | Fp8Weight | torch.Tensor:
    """The projection made of checkpoint projections `parts` (q/k/v, gate/up joined along the
    output dimension), as one grid; as a dense weight where the parts' grids differ."""
    if len(qs) == 1:
        return qs[0]
    if any(isinstance(q, Fp8Weight) for q in qs):
        if not all(isinstance(q, Fp8Weight) and q.codes.shape[1] == qs[0].codes.shape[1] for q in qs):
            shapes = ", ".join(f"{p} {tuple(getattr(q, 'codes').shape)}" for p, q in zip(parts, qs))
            raise LlmoptError(f"{where}: FP8 projections do not fit together: {shapes}")
        # each part keeps its own scales (per row); a static input scale is shared, as vLLM does: the largest
        inputs = [q.input_scale for q in qs if q.input_scale is not None]
        return Fp8Weight(codes=torch.cat([q.codes for q in qs]), scales=torch.cat([q.scales for q in qs]),
                         strategy="channel", input_scale=torch.stack(inputs).amax(0) if inputs else None)
    if any(not torch.equal(q.g_idx, qs[0].g_idx) for q in qs):
        # parts quantized with different act-order permutations cannot share one int4 layer
        return torch.cat([q.dequantize() for q in qs])
    try:
        if all(isinstance(q, PackedQuantizedWeight) for q in qs):  # the codes stay packed, read part by part
            return PackedQuantizedWeight.stacked(qs)
        return QuantizedWeight(codes=torch.cat([q.codes for q in qs]), scales=torch.cat([q.scales for q in qs]),
                               zeros=torch.cat([q.zeros for q in qs]), g_idx=qs[0].g_idx, scheme=qs[0].scheme)
    except (RuntimeError, ValueError):
        shapes = ", ".join(f"{p} {tuple(q.shape)}" for p, q in zip(parts, qs))
        raise LlmoptError(f"{where}: packed projections do not fit together: {shapes}") from None

