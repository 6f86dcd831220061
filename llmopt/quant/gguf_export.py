"""GGUF export: write a model as a file llama.cpp loads and runs directly.

llama.cpp (and what is built on it: llama-cpp-python, Ollama, LM Studio) is how most people
run a model on a laptop CPU, so `llmopt quantize` must hand it a file it takes as is. We
write what llama.cpp's own convert_hf_to_gguf.py writes: its architecture keys, its tensor
names, its q/k row permutation for the "llama" architecture, and the byte-level BPE
vocabulary with the pre-tokenizer name that makes llama.cpp split text exactly as our
tokenizer does. Our reader (core/gguf_file.py) reads these files back.

F32/F16/BF16 and the block types Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 are quantized in Python
by the `gguf` package. The K-quant mixes (Q4_K_M, Q5_K_M, Q6_K) choose a type per tensor
inside llama.cpp's quantizer and have no Python implementation, so for those we write an
F16 file first and let llama.cpp quantize it through llama-cpp-python.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import math
import os
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from llmopt.core.atomic import atomic_file
from llmopt.core.config import ModelConfig
from llmopt.core.gguf_file import _HF_LAYER_TENSORS, _LLAMA3_REGEX, _QWEN2_REGEX, gguf_tensor_name
from llmopt.core.output_paths import check_output
from llmopt.errors import LlmoptError
from llmopt.model.rope import rope_inv_freq

if TYPE_CHECKING:  # gguf is imported where used, like core/gguf_file.py does
    from gguf import GGMLQuantizationType, GGUFWriter

    from llmopt.core.tokenizer import Tokenizer

logger = logging.getLogger("llmopt.quant")

GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K_M", "Q5_K_M", "Q6_K")
K_QUANT_TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K")

# our model families -> llama.cpp architectures (its converter writes Mistral as "llama")
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}

# Hugging Face name -> GGUF name: the reader's tables, inverted, so both directions agree

# tokenizers' pre-tokenizer regexes -> llama.cpp pre-tokenizer names that split the same way
_SPLIT_REGEX_PRES = {_LLAMA3_REGEX: "llama-bpe", _QWEN2_REGEX: "qwen2"}
_FALLBACK_PRE = "gpt-2"  # llama.cpp's "default" splits differently from GPT-2; "gpt-2" is the plain regex


def write_gguf(
    out: Path,
    config: dict[str, Any],
    tensors: Mapping[str, torch.Tensor],
    tokenizer: Tokenizer,
    gguf_type: str,
    overwrite: bool = False,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Write a GGUF file of `gguf_type` (one of GGUF_TYPES) that llama.cpp runs; returns `out`.

    `config` is a Hugging Face config.json dict, `tensors` Hugging Face-named tensors in
    Hugging Face layout (lm_head may be absent when embeddings are tied); they are fetched
    and written one at a time (`gguf_file`). `metadata` adds string keys (e.g.
    "general.name", default: the file's stem). The file appears complete or not at all.
    """
    with gguf_file(out, config, {name: tuple(tensors[name].shape) for name in tensors}, tokenizer, gguf_type,
                   overwrite=overwrite, metadata=metadata) as sink:
        for name in sink.names:
            sink.write(name, tensors[name])
    return Path(out)


@contextmanager
def gguf_file(
    out: Path,
    config: dict[str, Any],
    shapes: Mapping[str, tuple[int, ...]],
    tokenizer: Tokenizer,
    gguf_type: str,
    overwrite: bool = False,
    metadata: dict[str, str] | None = None,
) -> Iterator[GGUFTensorWriter]:
    """A GGUF file being written: the header, metadata and every tensor's info (from
    `shapes`, Hugging Face names -> shapes) are on disk before the body runs; the body hands
    the yielded writer each tensor (whole, or in row pieces), in any order. On leaving, a
    K-quant file is quantized by llama.cpp and the file takes its name `out`; on an error
    nothing is left behind."""
    out = Path(out)
    if gguf_type not in GGUF_TYPES:
        raise LlmoptError(f"unknown GGUF type {gguf_type!r}; choose one of: {', '.join(GGUF_TYPES)}")
    check_output(out, overwrite)
    cfg = ModelConfig.from_hf(config)
    metadata = {"general.name": out.stem, **(metadata or {})}
    with atomic_file(out) as tmp:
        if gguf_type in K_QUANT_TYPES:
            with _scratch_file(out) as f16:
                writer = GGUFTensorWriter(f16, cfg, shapes, tokenizer, "F16", metadata)
                yield writer
                writer.close()
                _llama_cpp_quantize(f16, tmp, gguf_type)
        else:
            writer = GGUFTensorWriter(tmp, cfg, shapes, tokenizer, gguf_type, metadata)
            yield writer
            writer.close()


# ---- the file ---------------------------------------------------------------------------
@dataclass(frozen=True)
class _PlannedTensor:
    name: str  # llama.cpp's name
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    nbytes: int
    offset: int  # absolute, in the file
    qk_heads: int | None  # rows permuted into llama.cpp's q/k order, for this many heads


class GGUFTensorWriter:
    """A GGUF file whose layout is planned before any tensor data arrives, so a model is
    written one tensor at a time and nothing of it needs to stay in memory.

    The `gguf` package's GGUFWriter writes the header, the metadata and the tensor infos
    (names, shapes, types; offsets follow from each type's block size); each tensor's data is
    then quantized with `gguf.quants` and written to its offset with `pwrite`. Not GGUFWriter's
    `write_tensor_data`: it takes whole tensors in file order, and the embedding table and
    output projection arrive in row pieces (streaming.py) so that they never exist whole in
    float32. The bytes equal GGUFWriter's own `add_tensor` + `write_tensors_to_file` (zero
    padding to the data alignment between tensors).
    """

    def __init__(self, path: Path, cfg: ModelConfig, shapes: Mapping[str, tuple[int, ...]], tokenizer: Tokenizer,
                 gguf_type: str, metadata: dict[str, str]):
        import gguf

        self.path = Path(path)
        target = gguf.GGMLQuantizationType[gguf_type]
        arch = GGUF_ARCHITECTURES[cfg.model_type]
        writer = gguf.GGUFWriter(str(path), arch)
        try:
            _add_model_keys(writer, cfg, gguf_type)
            _add_tokenizer(writer, tokenizer, cfg)
            for key, value in metadata.items():
                if key in writer.kv_data[0]:
                    raise LlmoptError(f"metadata key {key!r} is written by the GGUF exporter itself; drop it")
                writer.add_string(key, str(value))
            rope_freqs = _rope_freqs(cfg)
            infos = list(_tensor_infos(cfg, shapes, target, rope_freqs))
            for _, name, shape, qtype, _ in infos:
                # tensor_dtype only matters for raw bytes (uint8); the shape is the logical one
                writer.add_tensor_info(name, shape, np.dtype(np.float32), _nbytes(shape, qtype), raw_dtype=qtype)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            offset = writer.ggml_pad(writer.fout[0].tell(), writer.data_alignment)
            alignment = writer.data_alignment
        finally:
            writer.close()
        # the offsets GGUFWriter.write_ti_data_to_file wrote: each tensor padded to the alignment
        self._planned: dict[str, _PlannedTensor] = {}
        for hf_name, name, shape, qtype, heads in infos:
            nbytes = _nbytes(shape, qtype)
            self._planned[hf_name] = _PlannedTensor(name, shape, qtype, nbytes, offset, heads)
            offset += writer.ggml_pad(nbytes, alignment)
        os.truncate(self.path, offset)  # the padding between tensors stays zero, as GGUFWriter writes it
        self._missing = {hf_name: p.nbytes for hf_name, p in self._planned.items()}
        self._skipped = set(shapes) - set(self._planned)
        self.names = [hf_name for hf_name in shapes if hf_name in self._planned]  # what write() still expects
        if rope_freqs is not None:
            self.write(ROPE_FREQS, rope_freqs)

    def write(self, name: str, tensor: torch.Tensor, row_start: int = 0) -> None:
        """Quantize and write Hugging Face tensor `name`, or its rows from `row_start` on."""
        import gguf

        planned = self._planned.get(name)
        if planned is None:
            if name in self._skipped:  # a tied lm_head, an old checkpoint's rotary inv_freq
                return
            raise ValueError(f"tensor {name!r} is not in the GGUF file's plan")
        shape = tuple(tensor.shape)
        whole = shape == planned.shape and row_start == 0
        rows_fit = len(shape) >= 1 and shape[1:] == planned.shape[1:] and row_start + shape[0] <= planned.shape[0]
        if not (whole or rows_fit) or (planned.qk_heads and not whole):
            raise ValueError(f"tensor {name!r}: {shape} at row {row_start} does not fit the plan's {planned.shape}")
        array = tensor.detach().to(torch.float32).cpu().numpy()
        if planned.qk_heads:
            array = _permute_qk(array, planned.qk_heads)
        data = gguf.quants.quantize(np.ascontiguousarray(array), planned.qtype)
        view = memoryview(data.reshape(-1).view(np.uint8))
        at = planned.offset + (row_start * planned.nbytes // planned.shape[0] if row_start else 0)
        with open(self.path, "r+b", buffering=0) as f:
            done = 0
            while done < len(view):
                done += os.pwrite(f.fileno(), view[done:], at + done)
        self._missing[name] -= len(view)

    def close(self) -> None:
        """Check every planned tensor was written in full."""
        unwritten = [name for name, left in self._missing.items() if left]
        if unwritten:
            raise RuntimeError(f"GGUF file incomplete: {len(unwritten)} tensor(s) not written, e.g. {unwritten[:3]}")


ROPE_FREQS = "rope_freqs.weight"  # computed from the config, not read from the checkpoint


def _nbytes(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    from gguf import GGML_QUANT_SIZES

    block_size, type_size = GGML_QUANT_SIZES[qtype]
    return math.prod(shape) // block_size * type_size


def _rope_freqs(cfg: ModelConfig) -> torch.Tensor | None:
    """llama.cpp applies Llama-3.1 RoPE scaling as per-frequency divisors in a tensor."""
    if cfg.rope_type == "freq_factors":
        return torch.tensor(cfg.rope_scaling["freq_factors"], dtype=torch.float32)
    if cfg.rope_type != "llama3":
        return None
    unscaled = rope_inv_freq(dataclasses.replace(cfg, rope_scaling=None))
    return (unscaled / rope_inv_freq(cfg)).to(torch.float32)


def _tensor_infos(cfg: ModelConfig, shapes: Mapping[str, tuple[int, ...]], target: GGMLQuantizationType,
                  rope_freqs: torch.Tensor | None) -> Iterator[tuple[str, str, tuple[int, ...], GGMLQuantizationType, int | None]]:
    """(Hugging Face name, GGUF name, shape, storage type, q/k heads) for every tensor the file
    holds, in file order: rope factors (Llama 3.1 scaling) first, then `shapes`' order."""
    required = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{hf}.weight" for i in range(cfg.num_hidden_layers) for hf in _HF_LAYER_TENSORS
    }
    if not cfg.tie_word_embeddings:
        required.add("lm_head.weight")
    missing = sorted(required - shapes.keys())
    if missing:
        raise LlmoptError(f"cannot export to GGUF: {len(missing)} tensor(s) missing, e.g. {', '.join(missing[:3])}")
    output_name = "token_embd.weight" if cfg.tie_word_embeddings else "output.weight"
    if rope_freqs is not None:
        shape = tuple(rope_freqs.shape)
        yield ROPE_FREQS, "rope_freqs.weight", shape, _storage_type("rope_freqs.weight", shape, target, output_name), None
    for hf_name, shape in shapes.items():
        if hf_name.endswith("rotary_emb.inv_freq"):  # some old checkpoints carry it; llama.cpp recomputes it
            continue
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name = gguf_tensor_name(hf_name)
        if name is None:
            raise LlmoptError(f"cannot export to GGUF: no llama.cpp name for tensor {hf_name!r}")
        heads = None
        if GGUF_ARCHITECTURES[cfg.model_type] == "llama" and name.split(".")[-2] in ("attn_q", "attn_k"):
            heads = cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads
        shape = tuple(shape)
        yield hf_name, name, shape, _storage_type(name, shape, target, output_name), heads


def _add_model_keys(writer: GGUFWriter, cfg: ModelConfig, gguf_type: str) -> None:
    import gguf

    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    # head_dim may differ from hidden / heads (e.g. Mistral-Nemo); llama.cpp and our reader read these
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if cfg.rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(cfg.rope_scaling["factor"]))
    elif cfg.rope_type == "llama3" and cfg.model_type == "qwen2":
        raise LlmoptError("llama3 RoPE scaling on a qwen2 model cannot be exported: "
                          "llama.cpp's qwen2 architecture has no rope_freqs tensor")
    windows = [w for w in cfg.sliding_windows if w]
    if windows and min(windows) < cfg.max_position_embeddings:
        logger.warning("llama.cpp's %s architecture has no sliding-window attention: beyond %d tokens "
                       "it attends further back than the original model", writer.arch, min(windows))
    file_type = "ALL_F32" if gguf_type == "F32" else f"MOSTLY_{gguf_type}"
    writer.add_file_type(gguf.LlamaFileType[file_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (rotate-half halves -> interleaved pairs); gguf_file._unpermute_qk inverts it."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _storage_type(name: str, shape: tuple[int, ...], target: GGMLQuantizationType,
                  output_name: str) -> GGMLQuantizationType:
    """The type one tensor is stored in when the file's type is `target`."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

    if len(shape) == 1:  # norms, biases, rope factors: tiny, and llama.cpp keeps them F32
        return T.F32
    if name == output_name and target in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
        # llama.cpp's quantizer gives the output projection more bits (Q6_K) in these files too;
        # Q8_0 is the nearest type we can write in Python
        target = T.Q8_0
    if shape[-1] % GGML_QUANT_SIZES[target][0]:
        return T.F16  # rows not made of whole blocks: F16, as convert_hf_to_gguf.py falls back
    return target


# ---- the tokenizer ----------------------------------------------------------------------
def _add_tokenizer(writer: GGUFWriter, tokenizer: Tokenizer, cfg: ModelConfig) -> None:
    """Byte-level BPE vocabulary, merges and special tokens, as llama.cpp's converter writes them."""
    from gguf import TokenType

    backend = tokenizer.backend
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise LlmoptError(f"cannot export a {model.get('type')} tokenizer to GGUF yet (only byte-level BPE)")
    pre = _pre_tokenizer_name(spec.get("pre_tokenizer"))

    vocab = backend.get_vocab(with_added_tokens=True)
    if max(vocab.values()) >= cfg.vocab_size:
        raise LlmoptError(f"the tokenizer has ids up to {max(vocab.values())} "
                          f"but the model's vocab_size is {cfg.vocab_size}")
    added = backend.get_added_tokens_decoder()
    # embedding rows beyond the tokenizer (padded vocabularies) get placeholder names, as in the converter
    tokens = [f"[PAD{i}]" for i in range(cfg.vocab_size)]
    types = [TokenType.UNUSED] * cfg.vocab_size
    for token, i in vocab.items():
        tokens[i] = token
        if i not in added:
            types[i] = TokenType.NORMAL
        else:
            types[i] = TokenType.CONTROL if added[i].special else TokenType.USER_DEFINED
    # tokenizer.json writes merges as "a b" strings (old) or [a, b] pairs (new)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)

    # the tokenizer's own special tokens first, the model config's ids where it names none
    bos = _token_id(tokenizer, tokenizer.bos_token, cfg.bos_token_id)
    eos = _token_id(tokenizer, tokenizer.eos_token, cfg.eos_token_ids[0] if cfg.eos_token_ids else None)
    # llama.cpp assumes id 11 for a missing BOS/EOS of a "gpt2" vocabulary, so write every one we know
    for add, idx in ((writer.add_bos_token_id, bos), (writer.add_eos_token_id, eos),
                     (writer.add_pad_token_id, _token_id(tokenizer, tokenizer.pad_token, None)),
                     (writer.add_unk_token_id, _token_id(tokenizer, tokenizer.unk_token, None))):
        if idx is not None:
            add(idx)
    # whether encode() adds BOS/EOS is the post-processor's business; ask it rather than parse it
    with_special = backend.encode("a", add_special_tokens=True).ids
    extra = len(with_special) > len(backend.encode("a", add_special_tokens=False).ids)
    writer.add_add_bos_token(extra and bos is not None and with_special[0] == bos)
    writer.add_add_eos_token(extra and eos is not None and with_special[-1] == eos)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def _token_id(tokenizer: Tokenizer, token: str | None, fallback: int | None) -> int | None:
    idx = tokenizer.token_to_id(token)
    return idx if idx is not None else fallback


def _pre_tokenizer_name(pre: dict[str, Any] | None) -> str:
    """The llama.cpp pre-tokenizer that splits text like this `tokenizers` pre-tokenizer."""
    pre = pre or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") for step in steps]
    if "ByteLevel" not in kinds:
        raise LlmoptError("cannot export this tokenizer to GGUF yet: only byte-level BPE (GPT-2 style) tokenizers "
                          f"are supported, its pre-tokenizer is {kinds or 'none'}")
    byte_level = steps[kinds.index("ByteLevel")]
    if not byte_level.get("add_prefix_space", False):  # llama.cpp's BPE never adds a prefix space
        uses_regex = byte_level.get("use_regex", True)
        if kinds == ["ByteLevel"] and uses_regex:
            return "gpt-2"
        if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and uses_regex:
            return "smollm"  # SmolLM / StarCoder: digits one by one, then the GPT-2 regex
        if kinds == ["Split", "ByteLevel"] and not uses_regex:
            name = _SPLIT_REGEX_PRES.get((steps[0].get("pattern") or {}).get("Regex"))
            if name:
                return name
    logger.warning("no llama.cpp pre-tokenizer is known to match %s; writing %r, so llama.cpp may split "
                   "some text differently from this tokenizer", kinds, _FALLBACK_PRE)
    return _FALLBACK_PRE


# ---- K-quants through llama.cpp ---------------------------------------------------------
def _llama_cpp_quantize(src: Path, dst: Path, gguf_type: str) -> None:
    try:
        import llama_cpp
    except ImportError:
        raise LlmoptError(f"{gguf_type} needs llama.cpp's quantizer: pip install llama-cpp-python "
                          "(or 'llmopt[gguf]')") from None
    from llama_cpp._logger import llama_log_callback as default_log_callback

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{gguf_type}")
    # llama.cpp logs every tensor it converts; collect its log for our logger and error messages
    # instead (llama-cpp-python's own callback maps llama.cpp's info lines to warnings)
    lines: list[str] = []

    @llama_cpp.llama_log_callback
    def collect(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        lines.append(text.decode("utf-8", errors="replace"))

    llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
    try:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    finally:
        llama_cpp.llama_log_set(default_log_callback, ctypes.c_void_p(0))
    log = "".join(lines).strip()
    logger.debug("llama.cpp quantize log:\n%s", log)
    if rc != 0:
        tail = " | ".join(log.splitlines()[-3:])
        raise LlmoptError(f"llama.cpp could not quantize the model to {gguf_type}: {tail}")


@contextmanager
def _scratch_file(beside: Path) -> Iterator[Path]:
    """A temporary file next to `beside` (same disk as the output), always removed afterwards."""
    fd, name = tempfile.mkstemp(prefix=f".{beside.name}.f16-", dir=beside.parent)
    os.close(fd)
    try:
        yield Path(name)
    finally:
        Path(name).unlink(missing_ok=True)
