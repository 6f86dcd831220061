"""Random weights of a model's shape, without a checkpoint (vLLM's `--load-format dummy`).

`DummyWeights` answers like `CheckpointReader` (names, shapes, one tensor at a time), so loading,
quantizing and benchmarking a 1B- or 8B-shaped model needs no download and no disk. Values are
deterministic: each tensor is a window into one fixed block of normal noise (std 0.02, the
initializer_range of Llama configs), started at an offset derived from the tensor's name, so
making an 8B model costs a memory copy per tensor rather than billions of random draws. Norm
weights are ones, as a freshly initialised model's are.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

from llmopt.core.config import ModelConfig

INIT_STD = 0.02
# a prime length, so windows of the block at different offsets never line up with a tensor's rows
_BLOCK = 1_000_003


def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of `config` holds, with its shape, in the order
    transformers names them."""
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        for name, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes[f"{p}.self_attn.{name}.weight"] = (out, h)
            if config.attention_bias:
                shapes[f"{p}.self_attn.{name}.bias"] = (out,)
        shapes[f"{p}.self_attn.o_proj.weight"] = (h, q)
        if config.o_proj_bias:
            shapes[f"{p}.self_attn.o_proj.bias"] = (h,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
        for name, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            shapes[f"{p}.mlp.{name}.weight"] = shape
            if config.mlp_bias:
                shapes[f"{p}.mlp.{name}.bias"] = (shape[0],)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


class DummyWeights:
    """A checkpoint of random weights for `config`, read like `CheckpointReader`."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
        self.config, self.dtype = config, dtype
        self.shapes = checkpoint_shapes(config)
        g = torch.Generator().manual_seed(seed)
        noise = torch.randn(_BLOCK, generator=g) * INIT_STD
        self._block = torch.cat([noise, noise]).to(dtype)  # doubled: any window up to _BLOCK is one slice

    def __contains__(self, name: str) -> bool:
        return name in self.shapes

    def __iter__(self):
        return iter(self.shapes)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.get(name)

    def names(self) -> list[str]:
        return list(self.shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def get(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            return torch.ones(shape, dtype=self.dtype)
        numel = 1
        for d in shape:
            numel *= d
        out = torch.empty(numel, dtype=self.dtype)
        offset = zlib.crc32(name.encode()) % _BLOCK
        done = 0
        while done < numel:
            n = min(_BLOCK, numel - done)
            out[done:done + n] = self._block[offset:offset + n]
            offset = (offset + 7919) % _BLOCK  # each block-sized chunk starts elsewhere
            done += n
        return out.reshape(shape)


def dummy_raw_config(raw: dict[str, Any], vocab_size: int, bos_token_id: int | None,
                     eos_token_id: int | list[int] | None) -> dict[str, Any]:
    """An architecture's config.json with the vocabulary of the tokenizer it will run with (so
    that a random-weight model can be prompted and served end to end), in bfloat16."""
    out = {**raw, "vocab_size": vocab_size, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
    out.setdefault("torch_dtype", "bfloat16")
    return out

