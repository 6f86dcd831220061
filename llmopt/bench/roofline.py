"""The memory roofline of a decode step: decode reads every weight once per step (and each
sequence's K/V), so bytes per step / memory bandwidth bounds tokens/s from above.

`decode_step_bytes` counts what one step streams: each linear layer's weights as its forward
reads them (`LinearBase.streamed_weight_bytes`: 4-bit codes and scales for int4 layers, the
int8 copy of a vocabulary projection that uses one), the norms, and the K/V of every
sequence's context in the KV cache's element type. The embedding table is not counted (a step
gathers one row per sequence). `measure_read_bandwidth` times a sum over a buffer far larger
than the caches, with the threads torch uses: the bandwidth our kernels can reach, not the
DIMMs' datasheet figure.
"""

from __future__ import annotations

import functools
import time

import torch

from llmopt.model.linear import LinearBase
from llmopt.model.llama import LlamaForCausalLM, RMSNorm


def weight_bytes_per_step(model: LlamaForCausalLM) -> int:
    linears = sum(m.streamed_weight_bytes() for m in model.modules() if isinstance(m, LinearBase))
    norms = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, RMSNorm))
    return linears + norms


def kv_bytes_per_token(model: LlamaForCausalLM, kv_dtype: torch.dtype) -> int:
    cfg = model.config
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * torch.empty((), dtype=kv_dtype).element_size()


def decode_step_bytes(model: LlamaForCausalLM, batch_size: int, context_len: int, kv_dtype: torch.dtype) -> int:
    """Bytes one decode step of `batch_size` sequences, each `context_len` tokens long, reads."""
    return weight_bytes_per_step(model) + batch_size * context_len * kv_bytes_per_token(model, kv_dtype)


def measure_read_bandwidth(device: torch.device | str = "cpu", size_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second a full-buffer sum reads, best of `repeats`."""
    device = torch.device(device)
    x = torch.ones(size_bytes // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass faults pages in / warms up
        _sync(device)
        start = time.perf_counter()
        x.sum()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    del x
    return size_bytes / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gguf_decode_step_bytes(path, batch_size: int, context_len: int) -> int:
    """The same count for llama.cpp on a GGUF file: its tensors as stored (the embedding table only
    where it doubles as the output projection) and an f16 K/V cache (llama.cpp's default)."""
    weights, kv_per_token = _gguf_step_figures(str(path))
    return weights + batch_size * context_len * kv_per_token


@functools.lru_cache(maxsize=8)
def _gguf_step_figures(path: str) -> tuple[int, int]:
    """(weight bytes a step reads, K/V bytes per token) of a GGUF file: reading its metadata takes
    seconds (the tokenizer's arrays), so once per file."""
    import gguf

    from llmopt.core import resolve

    tensors = gguf.GGUFReader(path).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    weights = sum(int(t.n_bytes) for t in tensors if tied or t.name != "token_embd.weight")
    cfg = resolve(path).config
    return weights, 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
