"""`load(source)` -> LoadedModel: config, tokenizer and our decoder with its weights."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from llmopt.core.config import ModelConfig
from llmopt.core.convert import DTYPES
from llmopt.core.quant_formats import dequantize_checkpoint
from llmopt.core.quantized_weight import QuantizedWeight
from llmopt.core.source import ModelSource, QuantizationInfo, resolve
from llmopt.core.tokenizer import Tokenizer
from llmopt.core.weights import load_safetensors, safetensors_files
from llmopt.errors import LlmoptError
from llmopt.model.linear import DenseLinear, LinearBase
from llmopt.model.llama import LlamaForCausalLM, checkpoint_names
from llmopt.model.ops import decoder_ops, select_backend
from llmopt.model.rope import rope_inv_freq


@dataclass
class LoadedModel:
    source: ModelSource
    config: ModelConfig
    tokenizer: Tokenizer
    model: LlamaForCausalLM
    dtype: torch.dtype
    device: torch.device

    @property
    def quantization(self) -> QuantizationInfo | None:
        return self.source.quantization

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.model.parameters()}.values())


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise LlmoptError(f"unknown dtype {dtype!r}; choose one of: auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_tokenizer(source: ModelSource | str) -> Tokenizer:
    """The model's tokenizer alone (from its folder, or from the GGUF file's metadata)."""
    if isinstance(source, str):
        source = resolve(source)
    if source.kind == "gguf":
        from llmopt.core.gguf_file import read_gguf_tokenizer

        return read_gguf_tokenizer(source.path)
    return Tokenizer.from_dir(source.path, extra_eos_token_ids=_generation_eos(source.path, source.config))


def load(source: ModelSource | str, dtype: str = "auto", device: str = "cpu", int4_kernels: bool = True) -> LoadedModel:
    """Load a model spec onto the kernel backend for its device and dtype (`llmopt.model.ops`,
    chosen here once). AWQ / GPTQ projections run on that backend's int4 kernel unless
    `int4_kernels` is False: then every layer holds dense dequantized weights (what code
    that reads or rewrites weights, such as the quantizer, needs)."""
    if isinstance(source, str):
        source = resolve(source)
    try:
        torch_device = torch.device(device)
    except RuntimeError:
        raise LlmoptError(f"unknown device {device!r}") from None
    if torch_device.type == "cuda" and not torch.cuda.is_available():
        raise LlmoptError("device 'cuda' requested but CUDA is not available on this machine")
    torch_dtype = resolve_dtype(dtype, torch_device)
    quant = source.quantization
    config = source.config
    unpacked = {}
    if source.kind == "gguf":
        from llmopt.core.gguf_file import read_gguf

        gguf = read_gguf(source.path)
        tensors, tokenizer = gguf.tensors, gguf.tokenizer
    else:
        tensors = load_safetensors(safetensors_files(source.path))
        tokenizer = load_tokenizer(source)
        if quant is not None and quant.method in ("awq", "gptq"):
            tensors, unpacked = _dequantized(tensors, quant, where=str(source.path))
    tokenizer.extra_eos_token_ids = sorted(set(tokenizer.extra_eos_token_ids) | set(config.eos_token_ids))
    try:
        kernels = select_backend(torch_device, torch_dtype)
    except ValueError as exc:  # a bad LLMOPT_KERNELS
        raise LlmoptError(str(exc)) from None
    model = build_model(config, tensors, torch_dtype, torch_device, where=str(source.path), kernels=kernels)
    if unpacked and int4_kernels:
        use_int4_kernels(model, unpacked, torch_dtype, kernels)
    return LoadedModel(source=source, config=config, tokenizer=tokenizer, model=model,
                       dtype=torch_dtype, device=torch_device)


def build_model(
    config: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
    where: str = "checkpoint", kernels: str = "reference",
) -> LlamaForCausalLM:
    """Our decoder holding `tensors` (HF names), checked for missing and mis-shaped tensors,
    its ops and layers set up for kernel backend `kernels`."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    expected = {name: p.shape for name, p in model.named_parameters()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    sources = {name: checkpoint_names(name) for name in expected}
    missing = [part for parts in sources.values() for part in parts if part not in tensors]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise LlmoptError(f"{where} is missing tensor(s) {shown}")
    state = {}
    for name, parts in sources.items():
        tensor = tensors[parts[0]] if len(parts) == 1 else _stack(tensors, parts, where)
        if tensor.shape != expected[name]:
            raise LlmoptError(
                f"{where}: tensor {', '.join(parts)} has shape {tuple(tensor.shape)}, config implies {tuple(expected[name])}"
            )
        # a private copy even when no conversion is needed: safetensors tensors are views of
        # the memory-mapped file, and one live view keeps every page of the file read so far
        # (here: the q/k/v and gate/up parts read for stacking) in our resident memory
        state[name] = tensor.to(device=device, dtype=dtype, copy=len(parts) == 1)
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    # non-persistent buffers were created on the meta device; compute them for real
    model.model.rotary_emb.inv_freq = rope_inv_freq(config).to(device)
    model.use_ops(decoder_ops(kernels, dtype))
    for module in model.modules():
        if isinstance(module, LinearBase):
            module.prepare(kernels)
    return model.eval()


def _dequantized(tensors: dict[str, torch.Tensor], quant: QuantizationInfo, where: str):
    """AWQ / GPTQ int4 projections unpacked: dense weights (the reference path) and codes + grids by prefix."""
    if quant.group_size is None or quant.bits is None:
        raise LlmoptError(f"{where}: quantization_config needs 'bits' and 'group_size'")
    v2 = quant.details.get("checkpoint_format") == "gptq_v2"
    return dequantize_checkpoint(tensors, quant.method, int(quant.bits), int(quant.group_size), gptq_v2=v2)


# The vocabulary projection's copy on fp32 CPU int4 models: "int8" (llama.cpp's Q8_0, what
# its own GGUF files use for this tensor) or "bf16"; measured side by side in docs/benchmarks.md.
INT4_MODEL_LM_HEAD = "int8"


def use_int4_kernels(model: LlamaForCausalLM, unpacked: dict, dtype: torch.dtype, kernels: str) -> None:
    """Swap each int4 projection's dense weight for the int4 layer of kernel backend `kernels`
    (`make_int4_linear`: llmopt's C++ kernel for fp32 CPU models, PyTorch's CPU int4 kernel for
    bf16/fp16 ones, the Triton kernel on CUDA).

    Fused projections (q/k/v, gate/up) join their parts along the output dimension; a
    layer the kernel cannot take (odd group layout) keeps its dense weight.
    """
    from llmopt.model.int4_linear import make_int4_linear

    device = model.lm_head.weight.device
    swapped = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, LinearBase):
            continue
        parts = [p[: -len(".weight")] for p in checkpoint_names(f"{name}.weight")]
        if not all(p in unpacked for p in parts):
            continue
        qs = [unpacked[p] for p in parts]
        if any(not torch.equal(q.g_idx, qs[0].g_idx) for q in qs):
            continue
        joined = QuantizedWeight(codes=torch.cat([q.codes for q in qs]), scales=torch.cat([q.scales for q in qs]),
                                 zeros=torch.cat([q.zeros for q in qs]), g_idx=qs[0].g_idx, scheme=qs[0].scheme)
        bias = getattr(module, "bias", None)
        layer = make_int4_linear(joined, None if bias is None else bias.cpu(), kernels, dtype)
        if layer is not None:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, layer.to(device))
            swapped += 1
    # with 4-bit projections the fp32 vocabulary projection (often the tied embeddings) would be
    # the largest read of a decode step: run it on a compact copy (docs/benchmarks.md, issue 13)
    if swapped and kernels == "cpu" and dtype == torch.float32 and isinstance(model.lm_head, DenseLinear):
        model.lm_head.use_compact_copy(INT4_MODEL_LM_HEAD)


def _stack(tensors: dict[str, torch.Tensor], parts: list[str], where: str) -> torch.Tensor:
    try:
        return torch.cat([tensors[p] for p in parts], dim=0)
    except RuntimeError:
        shapes = ", ".join(f"{p} {tuple(tensors[p].shape)}" for p in parts)
        raise LlmoptError(f"{where}: tensors do not fit together: {shapes}") from None


def _generation_eos(folder: Path, config: ModelConfig) -> list[int]:
    path = folder / "generation_config.json"
    ids = list(config.eos_token_ids)
    if path.exists():
        try:
            eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
        except json.JSONDecodeError:
            eos = None
        for e in eos if isinstance(eos, list) else [eos]:
            if isinstance(e, int) and e not in ids:
                ids.append(e)
    return ids
