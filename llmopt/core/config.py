"""Normalised architecture config: the one place that reads a Hugging Face config.json.

Hugging Face configs of the Llama family differ in small ways (rope_theta vs
rope_parameters, sliding-window keys, bias flags, head_dim present or derived);
`ModelConfig.from_hf` folds them into one dataclass our decoder understands.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from llmopt.errors import LlmoptError

# architecture class name -> our family name
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_MODEL_TYPES = set(SUPPORTED_ARCHITECTURES.values())
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")
MAX_LAYERS = 4096

_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


@dataclass
class ModelConfig:
    architecture: str  # e.g. "LlamaForCausalLM"
    model_type: str  # "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": ..., "factor": ..., ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v (and o for llama) projections carry a bias
    o_proj_bias: bool = False
    mlp_bias: bool = False
    # one entry per layer: None = full attention, int = sliding window size
    sliding_windows: list[int | None] = field(default_factory=list)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None

    @property
    def rope_type(self) -> str:
        return (self.rope_scaling or {}).get("rope_type", "default")

    @property
    def num_parameters(self) -> int:
        """Parameter count implied by the config (tied embeddings counted once)."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        attn = h * q + 2 * h * kv + q * h
        attn += (q + 2 * kv) * self.attention_bias + h * self.o_proj_bias
        mlp = 3 * h * self.intermediate_size + (2 * self.intermediate_size + h) * self.mlp_bias
        per_layer = attn + mlp + 2 * h
        embed = self.vocab_size * h
        return embed * (1 if self.tie_word_embeddings else 2) + self.num_hidden_layers * per_layer + h

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hf(cls, raw: dict[str, Any], where: str = "config.json") -> "ModelConfig":
        """The config of `raw`, every value checked (types, positive sizes, heads that split evenly):
        a bad value is one LlmoptError naming the key, as transformers' PretrainedConfig refuses it."""
        architecture = _architecture_of(raw, where)
        model_type = SUPPORTED_ARCHITECTURES[architecture]
        missing = [k for k in _REQUIRED_KEYS if raw.get(k) is None]
        if missing:
            raise LlmoptError(f"{where} is missing required key(s): {', '.join(missing)}")
        get = _Checked(raw, where)
        hidden = get.size("hidden_size")
        heads = get.size("num_attention_heads")
        kv_heads = get.size("num_key_value_heads", heads)
        # per-layer lists (sliding windows, the decoder's layers) are built from this count before any
        # weight is read: a bound keeps a crafted 2**31 from taking all the memory (the largest models
        # have under 200 layers; build_model checks the count against the checkpoint's tensors)
        layers = get.size("num_hidden_layers", maximum=MAX_LAYERS)
        if raw.get("head_dim") is None and hidden % heads:
            raise LlmoptError(f"{where}: hidden_size={hidden} is not a multiple of num_attention_heads={heads} "
                              "(and no head_dim is given)")
        head_dim = get.size("head_dim", hidden // heads)
        if head_dim % 2:
            raise LlmoptError(f"{where}: head_dim={head_dim} must be even (rotary embeddings rotate pairs)")
        if heads % kv_heads != 0:
            raise LlmoptError(
                f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        act = raw.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise LlmoptError(f"{where}: hidden_act {act!r} is not supported (only silu)")

        rope_theta, rope_scaling = _rope_of(raw, where, head_dim)
        eos = raw.get("eos_token_id")
        eos_ids = [get.token_id("eos_token_id", e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
        bias = get.flag("attention_bias")
        return cls(
            architecture=architecture,
            model_type=model_type,
            vocab_size=get.size("vocab_size"),
            hidden_size=hidden,
            intermediate_size=get.size("intermediate_size"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=get.positive_number("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=get.size("max_position_embeddings", 2048),
            tie_word_embeddings=get.flag("tie_word_embeddings"),
            # qwen2 always has q/k/v bias and never o_proj bias
            attention_bias=True if model_type == "qwen2" else bias,
            o_proj_bias=False if model_type == "qwen2" else bias,
            mlp_bias=get.flag("mlp_bias"),
            sliding_windows=_sliding_windows_of(raw, model_type, layers, get),
            bos_token_id=None if raw.get("bos_token_id") is None else get.token_id("bos_token_id", raw["bos_token_id"]),
            eos_token_ids=eos_ids,
            torch_dtype=get.text("torch_dtype") or get.text("dtype"),
        )

    @classmethod
    def from_file(cls, path: Path) -> "ModelConfig":
        return cls.from_hf(read_json(path), where=str(path))


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LlmoptError(f"{path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LlmoptError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise LlmoptError(f"{path} must hold a JSON object")
    return data


def _architecture_of(raw: dict[str, Any], where: str) -> str:
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    model_type = raw.get("model_type")
    for arch, family in SUPPORTED_ARCHITECTURES.items():
        if family == model_type:
            return arch
    named = ", ".join(archs) if archs else (model_type or "none given")
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    raise LlmoptError(f"{where}: unsupported architecture {named}; supported: {supported}")


def _rope_of(raw: dict[str, Any], where: str, head_dim: int) -> tuple[float, dict[str, Any] | None]:
    # transformers >= 5 writes rope_parameters = {rope_type, rope_theta, ...};
    # older configs write rope_theta and rope_scaling = {type|rope_type, factor, ...}.
    for key in ("rope_parameters", "rope_scaling"):
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise LlmoptError(f"{where}: {key} must be an object, got {raw[key]!r}")
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = _Checked({"rope_theta": merged.pop("rope_theta", raw.get("rope_theta"))}, where).positive_number(
        "rope_theta", 10000.0)
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise LlmoptError(
            f"{where}: rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    if rope_type == "freq_factors":  # a divisor per frequency, as a GGUF's rope_freqs tensor gives them
        factors = merged.get("freq_factors")
        if (not isinstance(factors, list) or len(factors) != head_dim // 2
                or not all(isinstance(f, (int, float)) and not isinstance(f, bool) and f > 0 for f in factors)):
            raise LlmoptError(f"{where}: rope scaling 'freq_factors' needs head_dim / 2 = {head_dim // 2} "
                              "positive numbers")
        return theta, {"rope_type": rope_type, "freq_factors": [float(f) for f in factors]}
    if "factor" not in merged:
        raise LlmoptError(f"{where}: rope scaling {rope_type!r} needs a 'factor'")
    numbers = _Checked(merged, f"{where}: rope scaling")
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if merged.get(key) is not None:
            numbers.positive_number(key)
    return theta, {"rope_type": rope_type, **merged}


def _sliding_windows_of(raw: dict[str, Any], model_type: str, layers: int, get: _Checked) -> list[int | None]:
    window = raw.get("sliding_window")
    layer_types = raw.get("layer_types")
    if model_type == "llama" or not window:
        return [None] * layers
    window = get.size("sliding_window")
    if layer_types and len(layer_types) == layers:
        return [window if t == "sliding_attention" else None for t in layer_types]
    if model_type == "qwen2":
        if not raw.get("use_sliding_window", False):
            return [None] * layers
        first = get.count("max_window_layers", layers)
        return [window if i >= first else None for i in range(layers)]
    return [window] * layers  # mistral: every layer


class _Checked:
    """Values of a config dict, each checked for type and range; a bad one is one LlmoptError naming the key.

    JSON booleans are not numbers here (Python's bool is an int); whole floats (64.0) count as integers.
    """

    def __init__(self, raw: dict[str, Any], where: str):
        self.raw, self.where = raw, where

    def _bad(self, key: str, what: str, value: Any) -> LlmoptError:
        return LlmoptError(f"{self.where}: {key} must be {what}, got {value!r}")

    def _integer(self, key: str, value: Any, what: str) -> int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._bad(key, what, value)
        return value

    def size(self, key: str, default: int | None = None, maximum: int | None = None) -> int:
        """A positive integer (a width, a count of heads or layers), at most `maximum`."""
        value = self.raw.get(key)
        if value is None:
            value = default
        value = self._integer(key, value, "a positive integer")
        if value < 1:
            raise self._bad(key, "a positive integer", value)
        if maximum is not None and value > maximum:
            raise self._bad(key, f"at most {maximum}", value)
        return value

    def count(self, key: str, default: int) -> int:
        value = self.raw.get(key)
        value = self._integer(key, default if value is None else value, "a non-negative integer")
        if value < 0:
            raise self._bad(key, "a non-negative integer", value)
        return value

    def token_id(self, key: str, value: Any) -> int:
        value = self._integer(key, value, "a token id (a non-negative integer)")
        if value < 0:
            raise self._bad(key, "a token id (a non-negative integer)", value)
        return value

    def positive_number(self, key: str, default: float | None = None) -> float:
        value = self.raw.get(key)
        if value is None:
            value = default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise self._bad(key, "a positive number", value)
        return float(value)

    def flag(self, key: str) -> bool:
        value = self.raw.get(key)
        if value is None:
            return False
        if not isinstance(value, bool):
            raise self._bad(key, "true or false", value)
        return value

    def text(self, key: str) -> str | None:
        value = self.raw.get(key)
        if value is not None and not isinstance(value, str):
            raise self._bad(key, "a string", value)
        return value
