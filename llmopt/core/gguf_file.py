"""Reading GGUF files: metadata -> HF-style config, tensors -> HF names, tokenizer.

The one place that parses GGUF metadata. llama.cpp's converter stores Llama q/k
projection rows interleaved for its RoPE kernel; we undo that so the tensors match the
Hugging Face layout our decoder (and transformers) use.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmopt.core.tokenizer import Tokenizer
from llmopt.errors import LlmoptError

SUPPORTED_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_HF_LAYER_TENSORS = {hf: name for name, hf in _LAYER_TENSORS.items()}
_HF_GLOBAL_TENSORS = {hf: name for name, hf in _GLOBAL_TENSORS.items()}

# llama.cpp pre-tokenizer names -> regex used to split text before byte-level BPE
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGIT_SPLIT_PRES = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"}
_LLAMA3_PRES = {"llama-bpe", "llama3", "smaug-bpe"}
_GPT2_PRES = {"gpt-2", "gpt2", "default", "olmo", "jais"}
SUPPORTED_GGUF_PRE_TOKENIZERS = sorted(_DIGIT_SPLIT_PRES | _LLAMA3_PRES | _GPT2_PRES | {"qwen2"})


@dataclass
class GGUFModel:
    config: dict[str, Any]  # Hugging Face config.json content
    tensors: "GGUFTensors"  # Hugging Face names, float32, HF layout
    tokenizer: Tokenizer
    file_type: str  # e.g. "Q4_1": what most weights were quantized to


def read_gguf_metadata(path: Path):
    """Open a GGUF file, checking every tensor lies inside the file. Returns a GGUFReader."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except FileNotFoundError:
        raise LlmoptError(f"{path} does not exist") from None
    except Exception as exc:  # gguf raises ValueError/IndexError/struct errors on bad bytes
        raise LlmoptError(f"{path} is not a readable GGUF file (corrupt or truncated?): {exc}") from None
    for t in reader.tensors:
        if t.data.nbytes != t.n_bytes:
            raise LlmoptError(f"{path} is truncated: tensor {t.name} needs {t.n_bytes} bytes, file has {t.data.nbytes}")
    return reader


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_gguf_config(path: Path, reader=None) -> tuple[dict[str, Any], str]:
    """The HF-style config of a GGUF file and its main weight type (e.g. "Q4_1"), without dequantizing."""
    path = Path(path)
    reader = reader or read_gguf_metadata(path)
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise LlmoptError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    names = {t.name for t in reader.tensors}
    type_counts: dict[str, int] = {}
    for t in reader.tensors:
        if len(t.shape) == 2:  # matrices: norms stay F32 in every GGUF type
            type_counts[t.tensor_type.name] = type_counts.get(t.tensor_type.name, 0) + 1
    file_type = max(type_counts, key=type_counts.get) if type_counts else "F32"
    return _hf_config(reader, arch, names, path), file_type


def read_gguf(path: Path) -> GGUFModel:
    """Metadata, tensors under HF names (`GGUFTensors`: dequantized one at a time, on access) and
    the tokenizer of a GGUF file."""
    path = Path(path)
    reader = read_gguf_metadata(path)
    config, file_type = read_gguf_config(path, reader)
    return GGUFModel(config=config, tensors=GGUFTensors(reader, config, path), tokenizer=_tokenizer(reader, path),
                     file_type=file_type)


class GGUFTensors(Mapping):
    """A GGUF file's tensors under Hugging Face names and in their layout, each dequantized to
    float32 when asked for (the file stays memory-mapped, so a model is never held twice).
    Q4_0 projections can also be read as the int4 grid they are (`quantized`): 4-bit codes,
    one fp16 scale per 32 weights and a zero point of 8, what the int4 kernels take."""

    def __init__(self, reader, config: dict[str, Any], path: Path):
        self.config, self.path = config, path
        self._tensors = {}
        for t in reader.tensors:
            hf_name = _hf_tensor_name(t.name)
            if hf_name is not None:
                self._tensors[hf_name] = t

    def __getitem__(self, name: str) -> torch.Tensor:
        from gguf import quants

        t = self._tensors[name]
        try:
            array = quants.dequantize(t.data, t.tensor_type)
        except Exception as exc:
            raise LlmoptError(f"{self.path}: cannot dequantize {t.name} ({t.tensor_type.name}): {exc}") from None
        array = np.ascontiguousarray(array, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        if not array.flags.writeable:  # F32 tensors come back as views of the read-only file map
            array = array.copy()
        return self._hf_rows(name, torch.from_numpy(array))

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def quantized(self, name: str):
        """Tensor `name` as a `QuantizedWeight` when it is stored as Q4_0, else None."""
        from gguf import GGMLQuantizationType

        from llmopt.core.quantized_weight import QuantizedWeight, QuantScheme

        t = self._tensors.get(name)
        if t is None or t.tensor_type != GGMLQuantizationType.Q4_0 or len(t.shape) != 2:
            return None
        out_features, in_features = int(t.shape[1]), int(t.shape[0])
        # a Q4_0 block: fp16 scale d, then 16 bytes of nibbles; weights 0-15 in the low nibbles,
        # 16-31 in the high ones; w = (q - 8) * d
        blocks = np.asarray(t.data, dtype=np.uint8).reshape(out_features, in_features // 32, 18)
        scales = torch.from_numpy(blocks[..., :2].copy().view(np.float16).astype(np.float32)[..., 0])
        nibbles = torch.from_numpy(blocks[..., 2:].copy())
        codes = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(out_features, in_features)
        groups = in_features // 32
        q = QuantizedWeight(codes=codes, scales=scales, zeros=torch.full((out_features, groups), 8, dtype=torch.int16),
                            g_idx=(torch.arange(in_features) // 32).to(torch.int32),
                            scheme=QuantScheme(bits=4, group_size=32, sym=True))
        codes, scales, zeros = (self._hf_rows(name, x) for x in (q.codes, q.scales, q.zeros))
        return QuantizedWeight(codes=codes, scales=scales, zeros=zeros, g_idx=q.g_idx, scheme=q.scheme)

    def _hf_rows(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Undo llama.cpp's interleaving of Llama q/k rows (any row-wise tensor of them)."""
        if self.config["model_type"] == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self.config["num_attention_heads"] if "q_proj" in name else self.config["num_key_value_heads"]
            tensor = _unpermute_qk(tensor, heads)
        return tensor


def read_gguf_tokenizer(path: Path) -> Tokenizer:
    """Just the tokenizer of a GGUF file (no tensors dequantized)."""
    return _tokenizer(read_gguf_metadata(Path(path)), Path(path))


def _hf_tensor_name(name: str) -> str | None:
    """llama.cpp's tensor name -> Hugging Face's (None: a tensor our decoder does not hold)."""
    return _rename(name, r"blk\.(\d+)\.(\w+)\.(weight|bias)", "model.layers.{}.{}.{}", _LAYER_TENSORS, _GLOBAL_TENSORS)


def gguf_tensor_name(hf_name: str) -> str | None:
    """Hugging Face's tensor name -> llama.cpp's (the inverse of the reader's mapping)."""
    return _rename(hf_name, r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", "blk.{}.{}.{}", _HF_LAYER_TENSORS,
                   _HF_GLOBAL_TENSORS)


def _rename(name: str, layer_pattern: str, layer_name: str, layers: dict[str, str],
            globals_: dict[str, str]) -> str | None:
    m = re.fullmatch(layer_pattern, name)
    if m:
        mapped = layers.get(m.group(2))
        return layer_name.format(m.group(1), mapped, m.group(3)) if mapped else None
    base, _, kind = name.rpartition(".")
    mapped = globals_.get(base)
    return f"{mapped}.{kind}" if mapped else None


def _unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved pairs -> rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _hf_config(reader, arch: str, tensor_names: set[str], path: Path) -> dict[str, Any]:
    def key(name: str, default: Any = None, required: bool = False) -> Any:
        value = _field(reader, f"{arch}.{name}", default)
        if required and value is None:
            raise LlmoptError(f"{path}: GGUF metadata is missing {arch}.{name}")
        return value

    # values go into the config as stored: ModelConfig.from_hf checks each (type, positive, heads divide)
    heads = key("attention.head_count", required=True)
    hidden = key("embedding_length", required=True)
    blocks = key("block_count", required=True)
    _check_block_count(blocks, tensor_names, path)
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    eps = key("attention.layer_norm_rms_epsilon", 1e-5)
    head_dim = key("rope.dimension_count")
    if head_dim is None and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        head_dim = hidden // heads
    config: dict[str, Any] = {
        "architectures": [SUPPORTED_GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length", required=True),
        "num_hidden_layers": blocks,
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": head_dim,
        # stored as float32 in GGUF: print it back the way the original config wrote it
        "rms_norm_eps": float(f"{eps:.7g}") if isinstance(eps, float) else eps,
        "rope_theta": key("rope.freq_base", 10000.0),
        "max_position_embeddings": key("context_length", 2048),
        "vocab_size": key("vocab_size", len(tokens)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "attention_bias": any(n.endswith("attn_q.bias") for n in tensor_names) and arch == "llama",
        "torch_dtype": "float32",
    }
    scaling_type = key("rope.scaling.type")
    if scaling_type and scaling_type != "none":
        if scaling_type != "linear":
            raise LlmoptError(f"{path}: GGUF rope scaling {scaling_type!r} is not supported (only linear)")
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(key("rope.scaling.factor", 1.0))}
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:
        # Llama-3.1-style RoPE scaling: llama.cpp stores no parameters, only each frequency's divisor
        if config.get("rope_scaling"):
            raise LlmoptError(f"{path}: a rope_freqs tensor together with rope scaling {scaling_type!r}")
        if rope_freqs.tensor_type.name != "F32":
            raise LlmoptError(f"{path}: rope_freqs must be F32, got {rope_freqs.tensor_type.name}")
        factors = np.asarray(rope_freqs.data, dtype=np.float32).reshape(-1)  # their count: checked with the config
        config["rope_scaling"] = {"rope_type": "freq_factors", "freq_factors": [float(f) for f in factors]}
    for name in ("bos", "eos"):
        value = _field(reader, f"tokenizer.ggml.{name}_token_id")
        if value is not None:
            config[f"{name}_token_id"] = int(value)
    return config


def _check_block_count(blocks: Any, tensor_names: set[str], path: Path) -> None:
    """block_count must be the blocks the file holds tensors for: the decoder is built from it, so a
    wrong count (2**31) would build that many layers before any tensor is looked at."""
    held = {int(m.group(1)) for name in tensor_names if (m := re.match(r"blk\.(\d+)\.", name))}
    # held is blocks 0..N-1 exactly when it has N members, the largest N-1 (no range(N) is built)
    if (not isinstance(blocks, int) or isinstance(blocks, bool) or len(held) != blocks
            or max(held, default=-1) != blocks - 1):
        raise LlmoptError(f"{path}: GGUF metadata says block_count={blocks!r}, but the file holds tensors for "
                          f"{len(held)} block(s){' (numbered 0..' + str(max(held)) + ')' if held else ''}")


def _tokenizer(reader, path: Path) -> Tokenizer:
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise LlmoptError(
            f"{path}: GGUF tokenizer model {kind!r} is not supported yet (only byte-level BPE, 'gpt2'); "
            "load the model's Hugging Face folder instead"
        )
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    token_types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}

    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _LLAMA3_PRES))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    if pre in _DIGIT_SPLIT_PRES:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
    elif pre in _LLAMA3_PRES or pre == "qwen2":
        regex = _QWEN2_REGEX if pre == "qwen2" else _LLAMA3_REGEX
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False), byte_level]
        )
    elif pre in _GPT2_PRES:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        raise LlmoptError(
            f"{path}: GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(SUPPORTED_GGUF_PRE_TOKENIZERS)}"
        )
    backend.decoder = decoders.ByteLevel()
    # token types: 3 = control (special), 4 = user-defined (added, not special)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, token_types) if k == 3])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, token_types) if k == 4])

    def token_of(name: str) -> str | None:
        idx = _field(reader, f"tokenizer.ggml.{name}_token_id")
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    bos = token_of("bos")
    if _field(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, vocab[bos])]
        )
    return Tokenizer(
        backend=backend,
        chat_template=_field(reader, "tokenizer.chat_template"),
        bos_token=bos,
        eos_token=token_of("eos"),
        pad_token=token_of("padding"),
        unk_token=token_of("unknown"),
    )
