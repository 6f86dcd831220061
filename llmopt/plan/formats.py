"""Bytes a model's weights take in each storage format, from its architecture alone.

The counts follow what the writers store: AWQ/GPTQ (llmopt's and AutoAWQ's "GEMM" layout) keep
4-bit codes packed 8 per int32, a 4-bit zero point packed the same way and an fp16 scale per
group of input columns and output column (GPTQ also an int32 group index per input column),
and leave the embeddings, the output projection and
the norms in fp16; int8 keeps a byte per weight and an fp16 scale per output channel; FP8
(compressed-tensors, llm-compressor's FP8_DYNAMIC) a byte per weight (e4m3) and a float32 scale
per output channel, the rest in fp16 as the int4 writers do. GGUF
block types store each 2-D tensor in blocks of 32 (or 256) weights with their scales (Q8_0:
34 bytes per 32 weights), 1-D tensors in F32, and the output projection of the Q4_x/Q5_x
files in a wider type (llmopt's writer: Q8_0). The K-quant mixes pick a type per tensor
inside llama.cpp's quantizer; for them the average bits per weight llama.cpp reports for
Llama-class models is used, so those figures are estimates (within a few percent).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmopt.core.config import ModelConfig


@dataclass(frozen=True)
class WeightFormat:
    name: str
    linear_bits: float  # bits per weight of the decoder layers' projections, scales included
    other_bits: float  # bits per weight of the embeddings / output projection
    exact: bool = True  # False: an average over a per-tensor mix (K-quants)


def int4_bits(group: int) -> float:
    """4-bit code + an fp16 scale and a 4-bit zero point per `group` weights."""
    return 4 + (16 + 4) / group


def _block(bytes_per_block: int, weights_per_block: int) -> float:
    return 8 * bytes_per_block / weights_per_block


FORMATS: dict[str, WeightFormat] = {f.name: f for f in [
    WeightFormat("fp32", 32, 32),
    WeightFormat("bf16", 16, 16),
    WeightFormat("fp16", 16, 16),
    WeightFormat("int8", 8, 16),  # + a per-channel scale, added in weight_bytes
    WeightFormat("fp8", 8, 16),  # e4m3 + a float32 scale per output channel, added in weight_bytes
    WeightFormat("awq-int4-g128", int4_bits(128), 16),
    WeightFormat("awq-int4-g64", int4_bits(64), 16),
    WeightFormat("gptq-int4-g128", int4_bits(128), 16),
    WeightFormat("gguf-Q8_0", _block(34, 32), _block(34, 32)),
    WeightFormat("gguf-Q6_K", _block(210, 256), _block(210, 256)),
    WeightFormat("gguf-Q5_K_M", 5.69, 5.69, exact=False),
    WeightFormat("gguf-Q4_K_M", 4.85, 4.85, exact=False),
    WeightFormat("gguf-Q5_1", _block(24, 32), _block(34, 32)),
    WeightFormat("gguf-Q5_0", _block(22, 32), _block(34, 32)),
    WeightFormat("gguf-Q4_1", _block(20, 32), _block(34, 32)),
    WeightFormat("gguf-Q4_0", _block(18, 32), _block(34, 32)),
]}


@dataclass(frozen=True)
class ParameterCounts:
    linear: int  # decoder layers' projection weights (what int4/int8 quantize)
    linear_rows: int  # their output channels, summed (one scale each in int8)
    linear_cols: int  # their input channels, summed (GPTQ's g_idx: an int32 each)
    embedding: int
    output: int  # 0 when tied to the embeddings
    small: int  # norms and biases (1-D)


def parameter_counts(cfg: ModelConfig) -> ParameterCounts:
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter
    rows = q + 2 * kv + h + 2 * inter + h
    cols = 3 * h + q + 2 * h + inter
    bias = (q + 2 * kv) * cfg.attention_bias + h * cfg.o_proj_bias + (2 * inter + h) * cfg.mlp_bias
    embedding = cfg.vocab_size * h
    return ParameterCounts(linear=cfg.num_hidden_layers * per_layer, linear_rows=cfg.num_hidden_layers * rows,
                           linear_cols=cfg.num_hidden_layers * cols,
                           embedding=embedding, output=0 if cfg.tie_word_embeddings else embedding,
                           small=cfg.num_hidden_layers * (2 * h + bias) + h)


def weight_bytes(cfg: ModelConfig, fmt: WeightFormat) -> int:
    """Bytes of the stored weights (no file metadata)."""
    n = parameter_counts(cfg)
    small_bits = 32 if fmt.name.startswith(("gguf", "fp32")) else 16
    bits = n.linear * fmt.linear_bits + n.small * small_bits
    if fmt.name.startswith("gguf") and fmt.linear_bits != fmt.other_bits:
        # Q4_x / Q5_x: the token embeddings in the file's type, the output projection (or, tied, the
        # embedding table that serves as it) in the wider type
        head = n.output or n.embedding
        bits += (n.embedding if n.output else 0) * fmt.linear_bits + head * fmt.other_bits
    else:
        bits += (n.embedding + n.output) * fmt.other_bits
    if fmt.name == "int8":
        bits += n.linear_rows * 16
    if fmt.name == "fp8":
        bits += n.linear_rows * 32
    if fmt.name.startswith("gptq"):
        bits += n.linear_cols * 32
    return int(bits // 8)


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype_bytes: int = 2) -> int:
    """K and V of one token over all layers (full-attention layers; see kv_bytes)."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * kv_dtype_bytes


def kv_bytes(cfg: ModelConfig, context: int, kv_dtype_bytes: int = 2) -> int:
    """K/V one sequence of `context` tokens holds: a sliding-window layer keeps at most its window."""
    per_layer_token = 2 * cfg.num_key_value_heads * cfg.head_dim * kv_dtype_bytes
    windows = cfg.sliding_windows or [None] * cfg.num_hidden_layers
    return sum(per_layer_token * (context if w is None else min(context, w)) for w in windows)
