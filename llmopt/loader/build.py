"""Our decoder from checkpoint tensors: `build_model` checks and assigns them; `use_int4_kernels`
swaps AWQ / GPTQ projections for the kernel backend's int4 layers."""

from __future__ import annotations

import torch

from llmopt.core.config import ModelConfig
from llmopt.core.quant_formats import dequantize_checkpoint
from llmopt.core.quantized_weight import QuantizedWeight
from llmopt.core.source import QuantizationInfo
from llmopt.errors import LlmoptError
from llmopt.model.backends import KernelBackend, ReferenceBackend
from llmopt.model.linear import DenseLinear, LinearBase
from llmopt.model.llama import LlamaForCausalLM, checkpoint_names
from llmopt.model.rope import rope_inv_freq


def build_model(
    config: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
    where: str = "checkpoint", backend: KernelBackend | None = None,
) -> LlamaForCausalLM:
    """Our decoder holding `tensors` (HF names), checked for missing and mis-shaped tensors,
    its ops and layers set up for kernel backend `backend` (default: the reference)."""
    backend = backend or ReferenceBackend()
    # the decoder is built from the config before any tensor is matched: a layer count the checkpoint
    # cannot fill (num_hidden_layers 2**31) is refused here, not after building that many layers
    held = {name.split(".")[2] for name in tensors if name.startswith("model.layers.")}
    if config.num_hidden_layers > len(held):
        raise LlmoptError(f"{where}: the config says num_hidden_layers={config.num_hidden_layers}, but the "
                          f"checkpoint holds tensors for {len(held)} layer(s)")
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
    model.use_backend(backend, dtype)
    for module in model.modules():
        if isinstance(module, LinearBase):
            module.prepare(backend)
    return model.eval()


def _stack(tensors: dict[str, torch.Tensor], parts: list[str], where: str) -> torch.Tensor:
    try:
        return torch.cat([tensors[p] for p in parts], dim=0)
    except RuntimeError:
        shapes = ", ".join(f"{p} {tuple(tensors[p].shape)}" for p in parts)
        raise LlmoptError(f"{where}: tensors do not fit together: {shapes}") from None


def dequantized(tensors: dict[str, torch.Tensor], quant: QuantizationInfo, where: str):
    """AWQ / GPTQ int4 projections unpacked: dense weights (the reference path) and codes + grids by prefix."""
    if quant.group_size is None or quant.bits is None:
        raise LlmoptError(f"{where}: quantization_config needs 'bits' and 'group_size'")
    v2 = quant.details.get("checkpoint_format") == "gptq_v2"
    return dequantize_checkpoint(tensors, quant.method, int(quant.bits), int(quant.group_size), gptq_v2=v2)


def use_int4_kernels(model: LlamaForCausalLM, unpacked: dict, dtype: torch.dtype) -> None:
    """Swap each int4 projection's dense weight for the int4 layer of the model's kernel backend
    (`KernelBackend.int4_linear`: llmopt's C++ kernel for fp32 CPU models, PyTorch's CPU int4
    kernel for bf16/fp16 ones, the Triton kernel on CUDA, none on the reference backend).

    Fused projections (q/k/v, gate/up) join their parts along the output dimension; a
    layer the kernel cannot take (odd group layout) keeps its dense weight. With any layer
    swapped, the vocabulary projection moves to the compact copy the backend asks for.
    """
    backend = model.backend
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
        layer = backend.int4_linear(joined, None if bias is None else bias.cpu(), dtype)
        if layer is not None:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, layer.to(device))
            swapped += 1
    compact = backend.compact_vocab_projection(dtype)
    if swapped and compact is not None and isinstance(model.lm_head, DenseLinear):
        model.lm_head.use_compact_copy(compact)
