"""`load(source)` -> LoadedModel: config, tokenizer and our decoder with its weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmopt.core.config import ModelConfig
from llmopt.core.convert import DTYPES
from llmopt.core.source import ModelSource, QuantizationInfo, load_tokenizer, resolve
from llmopt.core.tokenizer import Tokenizer
from llmopt.core.weights import load_safetensors, safetensors_files
from llmopt.errors import LlmoptError
from llmopt.loader.build import build_model, dequantized, use_int4_kernels
from llmopt.model.llama import LlamaForCausalLM
from llmopt.model.backends import select_backend


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


def load(source: ModelSource | str, dtype: str = "auto", device: str = "cpu", int4_kernels: bool = True) -> LoadedModel:
    """Load a model spec onto the kernel backend for its device and dtype (`select_backend`,
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
            tensors, unpacked = dequantized(tensors, quant, where=str(source.path))
    tokenizer.extra_eos_token_ids = sorted(set(tokenizer.extra_eos_token_ids) | set(config.eos_token_ids))
    try:
        backend = select_backend(torch_device, torch_dtype)
    except ValueError as exc:  # a bad LLMOPT_KERNELS
        raise LlmoptError(str(exc)) from None
    model = build_model(config, tensors, torch_dtype, torch_device, where=str(source.path), backend=backend)
    if unpacked and int4_kernels:
        use_int4_kernels(model, unpacked, torch_dtype)
    return LoadedModel(source=source, config=config, tokenizer=tokenizer, model=model,
                       dtype=torch_dtype, device=torch_device)
