"""The Triton kernel variants llmopt can launch on a GPU, for the compile check and report.

The dispatch's own choices (split counts, tile sizes, paths) come from the launchers
(`llmopt.kernels.triton_variants.enumerate_variants`); this module supplies what the models and
engine flags decide: the dtypes a CUDA model computes in with every KV cache dtype the runtime
accepts for it (`resolve_kv_cache_dtype`), the (query heads per KV head, head dim) of the shipped
architecture configs, block sizes, the int4 group sizes of AWQ / GPTQ checkpoints, and the decoder
widths (hidden, intermediate, heads, head dim) the norm / rope / silu*up kernels are launched at.
"""

from __future__ import annotations

from llmopt.core.architectures import shipped_config, SHIPPED
from llmopt.kernels.triton_variants import VariantParams
from llmopt.runtime.config import KV_CACHE_DTYPES, EngineConfig, resolve_kv_cache_dtype

import torch

MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what a CUDA model may compute in
# vLLM's block sizes; llmopt's default (16) first
BLOCK_SIZES = (EngineConfig.block_size, 8, 32)
# AWQ / GPTQ group widths, per-channel (-1), and one no power-of-two tile divides (scales gathered per column)
INT4_GROUP_SIZES = (128, 64, 32, -1, 24)
# the tests' tiny models: query heads per KV head, head dim
TEST_MODEL_SHAPES = ((3, 64), (2, 16))
# (hidden, intermediate, query heads, KV heads, head dim) of the tests' tiny models, and Llama-3.1-405B's
# widths: a hidden size over one norm block (`triton_decoder_ops.NORM_MAX_BLOCK`), the two-pass path
EXTRA_DECODER_SHAPES = ((64, 128, 4, 2, 16), (16384, 53248, 128, 8, 128))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_pairs() -> list[tuple[str, str]]:
    """(model dtype, KV pool dtype) for every `--kv-cache-dtype` the runtime accepts on each model dtype."""
    pairs = []
    for model in MODEL_DTYPES:
        for name in KV_CACHE_DTYPES:
            try:
                pair = (_name(model), _name(resolve_kv_cache_dtype(name, model)))
            except Exception:  # a pool wider than the model: refused by the runtime
                continue
            if pair not in pairs:
                pairs.append(pair)
    return pairs


def attention_shapes() -> list[tuple[int, int]]:
    shapes = []
    for name in SHIPPED:
        config = shipped_config(name)
        shape = (config.num_attention_heads // config.num_key_value_heads, config.head_dim)
        if shape not in shapes:
            shapes.append(shape)
    return shapes + [s for s in TEST_MODEL_SHAPES if s not in shapes]


def decoder_shapes() -> list[tuple[int, int, int, int, int]]:
    shapes = []
    for name in SHIPPED:
        c = shipped_config(name)
        shape = (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim)
        if shape not in shapes:
            shapes.append(shape)
    return shapes + [s for s in EXTRA_DECODER_SHAPES if s not in shapes]


def shipped_params() -> VariantParams:
    """Every variant the runtime can launch for the shipped models and the tests' tiny ones."""
    return VariantParams(dtype_pairs=dtype_pairs(), attention_shapes=attention_shapes(),
                         block_sizes=list(BLOCK_SIZES), int4_x_dtypes=[_name(d) for d in MODEL_DTYPES],
                         int4_group_sizes=list(INT4_GROUP_SIZES), decoder_shapes=decoder_shapes())
