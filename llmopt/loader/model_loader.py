"""`load(source)` -> LoadedModel: config, tokenizer and our decoder with its weights."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from llmopt.core.config import ModelConfig
from llmopt.core.convert import DTYPES
from llmopt.core.device import resolve_device
from llmopt.core.dummy import DummyWeights, dummy_quantization
from llmopt.core.memory import available_memory_bytes
from llmopt.core.weights import open_weights
from llmopt.core.quantization_info import QuantizationInfo
from llmopt.core.source import LOAD_FORMATS, ModelSource, load_tokenizer, resolve
from llmopt.core.tokenizer import Tokenizer
from llmopt.errors import LlmoptError
from llmopt.loader.build import build_model
from llmopt.model.llama import LlamaForCausalLM
from llmopt.model.backends import select_backend

log = logging.getLogger("llmopt")


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


def resolve_dtype(dtype: str, device: torch.device, config: ModelConfig | None = None,
                  quantized: bool = False) -> torch.dtype:
    """The compute dtype: "auto" is float32 on CPU (llmopt's C++ kernels) unless the model's
    weights would not fit in memory as float32, then bfloat16; bfloat16 on GPUs."""
    if dtype == "auto":
        if device.type != "cpu":
            return torch.bfloat16
        if config is not None:
            need, available = weight_bytes(config, 4, quantized), available_memory_bytes()
            if available is not None and need > 0.9 * available:
                log.warning("float32 weights would need %.1f GiB with %.1f GiB available: loading in bfloat16 "
                            "(--dtype float32 to insist)", need / 2**30, available / 2**30)
                return torch.bfloat16
        return torch.float32
    if dtype not in DTYPES:
        raise LlmoptError(f"unknown dtype {dtype!r}; choose one of: auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def weight_bytes(config: ModelConfig, itemsize: int, quantized: bool = False) -> int:
    """Bytes of the model's weights held in memory at `itemsize` per dense value; an int4
    checkpoint's projections count at half a byte per weight plus their grid (held packed)."""
    if not quantized:
        return config.num_parameters * itemsize
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    projections = config.num_hidden_layers * (2 * h * q + 2 * h * kv + 3 * h * config.intermediate_size)
    return (config.num_parameters - projections) * itemsize + int(projections * 0.55)


def load(source: ModelSource | str, dtype: str = "auto", device: str = "auto", int4_kernels: bool = True,
         load_format: str = "auto", quantization: str | None = None) -> LoadedModel:
    """Load a model spec onto the kernel backend for its device and dtype (`select_backend`,
    chosen here once). AWQ / GPTQ projections run on that backend's int4 kernel unless
    `int4_kernels` is False: then every layer holds dense dequantized weights (what code
    that reads or rewrites weights, such as the quantizer, needs). `load_format` "dummy" gives
    random weights of the model's shape (`core.dummy`) instead of reading any; with `quantization`
    ("awq" / "gptq", vLLM's flag) its projections are random packed int4 tensors of that format,
    loaded as a real checkpoint's are. With a checkpoint, `quantization` must name its own method."""
    if isinstance(source, str):
        source = resolve(source)
    torch_device = resolve_device(device)
    config = source.config
    if load_format not in LOAD_FORMATS:
        raise LlmoptError(f"unknown load format {load_format!r}; choose one of: {', '.join(LOAD_FORMATS)}")
    if quantization is not None and load_format != "dummy":
        held = source.quantization.method if source.quantization is not None else None
        if quantization != held:
            raise LlmoptError(f"--quantization {quantization}: {source.spec} is {held or 'not quantized'} (with a "
                              f"checkpoint the flag names its own method; random {quantization} weights: "
                              "--load-format dummy)")
    if load_format == "dummy":
        # the source says what the weights are: random ones, dense or packed as asked
        source = replace(source, quantization=dummy_quantization(config, quantization) if quantization else None)
        weights, tokenizer = DummyWeights(config, quantization=source.quantization), load_tokenizer(source)
    elif source.kind == "gguf":
        from llmopt.core.gguf_file import read_gguf

        gguf = read_gguf(source.path)
        weights, tokenizer = gguf.tensors, gguf.tokenizer
    else:
        weights, tokenizer = open_weights(source), load_tokenizer(source)
    tokenizer.extra_eos_token_ids = sorted(set(tokenizer.extra_eos_token_ids) | set(config.eos_token_ids))
    # int4 projections are held packed; FP8 ones are dequantized to the compute dtype at load
    quantized = source.quantization is not None and (
        source.quantization.method in ("awq", "gptq")
        or (source.quantization.method == "compressed-tensors" and source.quantization.bits == 4))
    torch_dtype = resolve_dtype(dtype, torch_device, config, quantized)
    try:
        backend = select_backend(torch_device, torch_dtype)
    except ValueError as exc:  # a bad LLMOPT_KERNELS
        raise LlmoptError(str(exc)) from None
    model = build_model(config, weights, torch_dtype, torch_device, where=str(source.path), backend=backend,
                        quant=source.quantization, int4_kernels=int4_kernels)
    return LoadedModel(source=source, config=config, tokenizer=tokenizer, model=model,
                       dtype=torch_dtype, device=torch_device)
