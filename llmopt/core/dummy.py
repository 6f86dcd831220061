"""Random weights of a model's shape, without a checkpoint (vLLM's `--load-format dummy`).

`DummyWeights` answers like `CheckpointReader` (names, shapes, one tensor at a time), so loading,
quantizing and benchmarking a 1B- or 8B-shaped model needs no download and no disk. Values are
deterministic: each tensor is a window into one fixed block of normal noise (std 0.02, the
initializer_range of Llama configs), started at an offset derived from the tensor's name, so
making an 8B model costs a memory copy per tensor rather than billions of random draws. Norm
weights are ones, as a freshly initialised model's are.

With a `quantization` (`dummy_quantization`: vLLM's `--load-format dummy --quantization awq|gptq`)
every decoder projection is held as that format's packed checkpoint tensors instead (`qweight`,
`qzeros`, `scales`, GPTQ's `g_idx`, shapes from `quant_formats.packed_shapes`): random 4-bit codes
(windows into a fixed block of random int32 words), zero point 8, positive fp16 scales that give
the dense weights about the same spread as the dense noise. The loader reads them as it reads a real
AWQ / GPTQ checkpoint, through the same unpacking into the backend's int4 layers.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

from llmopt.core.config import ModelConfig
from llmopt.core.quant_formats import packed_shapes, quantization_config
from llmopt.core.quantized_weight import QuantScheme
from llmopt.core.quantization_info import QuantizationInfo
from llmopt.errors import LlmoptError

INIT_STD = 0.02
# a prime length, so windows of the block at different offsets never line up with a tensor's rows
_BLOCK = 1_000_003
DUMMY_QUANTIZATIONS = ("awq", "gptq")
GROUP_SIZES = (128, 64, 32)  # the first that divides every projection's input is used (128: the usual checkpoint's)
_ZERO_POINT = 8  # the middle of the 4-bit grid: codes 0..15 dequantize to scale * (-8..7)
_CODE_STD = 4.61  # the standard deviation of uniform codes 0..15 about the zero point 8
_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


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


def dummy_quantization(config: ModelConfig, method: str) -> QuantizationInfo:
    """The quantization of a random int4 checkpoint of `config` in `method`'s format (AWQ GEMM, or
    GPTQ v1 symmetric without act-order), as a real checkpoint's quantization_config reads; the
    group size is the first of GROUP_SIZES that divides every projection's input."""
    if method not in DUMMY_QUANTIZATIONS:
        raise LlmoptError(f"--quantization {method!r}: random packed weights are made for {', '.join(DUMMY_QUANTIZATIONS)}")
    inputs = {config.hidden_size, config.num_attention_heads * config.head_dim, config.intermediate_size}
    outputs = {config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim,
               config.hidden_size, config.intermediate_size}
    group = next((g for g in GROUP_SIZES if all(n % g == 0 for n in inputs)), None)
    if group is None or any(n % 8 for n in outputs):
        raise LlmoptError(f"--quantization {method}: the projections' sizes {sorted(inputs | outputs)} do not split into "
                          f"groups of {', '.join(map(str, GROUP_SIZES))} (inputs) and 8 packed codes (outputs)")
    scheme = QuantScheme(bits=4, group_size=group, sym=True)
    return QuantizationInfo(method=method, bits=4, group_size=group,
                            details={**quantization_config(method, scheme), "dummy": True})


def _repeated_nibble(value: int) -> int:
    """The int32 whose eight 4-bit fields all hold `value` (a packed row of equal zero points)."""
    word = sum(value << (4 * i) for i in range(8))
    return word - (1 << 32) if word >= 1 << 31 else word


class DummyWeights:
    """A checkpoint of random weights for `config`, read like `CheckpointReader`; with `quantization`
    (`dummy_quantization`), its projections packed as that int4 format's tensors."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                 quantization: QuantizationInfo | None = None):
        self.config, self.dtype, self.quantization = config, dtype, quantization
        self.shapes = checkpoint_shapes(config)
        self._packed: dict[str, torch.dtype] = {}
        g = torch.Generator().manual_seed(seed)
        noise = torch.randn(_BLOCK, generator=g) * INIT_STD
        self._block = torch.cat([noise, noise]).to(dtype)  # doubled: any window up to _BLOCK is one slice
        if quantization is not None:
            self._pack_projections(quantization)
            words = torch.randint(-(1 << 31), 1 << 31, (_BLOCK,), dtype=torch.int64, generator=g).to(torch.int32)
            self._words = torch.cat([words, words])
            # scales: |noise| spread about INIT_STD / _CODE_STD, so scale * (code - 8) has about the dense std
            self._scales = (torch.cat([noise, noise]).abs() * (1.25 / _CODE_STD) + INIT_STD / (4 * _CODE_STD)).half()

    def _pack_projections(self, quant: QuantizationInfo) -> None:
        scheme = QuantScheme(bits=4, group_size=int(quant.group_size), sym=True)
        for i in range(self.config.num_hidden_layers):
            for projection in _PROJECTIONS:
                prefix = f"model.layers.{i}.{projection}"
                out_features, in_features = self.shapes.pop(f"{prefix}.weight")
                for name, (dtype, shape) in packed_shapes(quant.method, prefix, out_features, in_features,
                                                          scheme).items():
                    self.shapes[name], self._packed[name] = shape, dtype

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

    def packed_dtype(self, name: str) -> torch.dtype | None:
        """The dtype of a packed int4 tensor (qweight, qzeros, scales, g_idx); None for a dense one."""
        return self._packed.get(name)

    def get(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            return torch.ones(shape, dtype=self.dtype)
        if name in self._packed:
            return self._get_packed(name, shape)
        return self._window(self._block, name, shape)

    def _get_packed(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        kind = name.rsplit(".", 1)[1]
        if kind == "qweight":  # every bit pattern is eight valid 4-bit codes
            return self._window(self._words, name, shape)
        if kind == "scales":
            return self._window(self._scales, name, shape)
        if kind == "qzeros":  # GPTQ v1 stores zero - 1
            stored = _ZERO_POINT - (self.quantization.method == "gptq")
            return torch.full(shape, _repeated_nibble(stored), dtype=torch.int32)
        group = int(self.quantization.group_size)  # g_idx: sequential groups (no act-order)
        return (torch.arange(shape[0], dtype=torch.int32) // group).to(torch.int32)

    @staticmethod
    def _window(block: torch.Tensor, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """`shape` filled from the doubled `block`, starting at an offset derived from `name`."""
        numel = 1
        for d in shape:
            numel *= d
        out = torch.empty(numel, dtype=block.dtype)
        offset = zlib.crc32(name.encode()) % _BLOCK
        done = 0
        while done < numel:
            n = min(_BLOCK, numel - done)
            out[done:done + n] = block[offset:offset + n]
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

