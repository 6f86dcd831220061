"""Streaming GGUF export: the file's layout is planned from the config, then each tensor is
quantized and written as it arrives. The bytes equal the in-memory export (the whole model
loaded, each tensor quantized, GGUFWriter's `add_tensor` + `write_tensors_to_file`), and no
more than about one tensor is alive at a time."""

from __future__ import annotations

import weakref
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from conftest import write_tiny_model
from llmopt.core import resolve
from llmopt.core.config import ModelConfig
from llmopt.core.gguf_file import gguf_tensor_name
from llmopt.core.source import load_tokenizer
from llmopt.core.weights import CheckpointReader, SafetensorsShardWriter, TensorSpec
from llmopt.loader import load
from llmopt.model.attention import EqualLengthAttention
from llmopt.quant import streaming
from llmopt.quant.calibration import load_calibration
from llmopt.quant.gguf_export import (GGUF_ARCHITECTURES, K_QUANT_TYPES, GGUFTensorWriter, _add_model_keys,
                                      _add_tokenizer, _llama_cpp_quantize, _permute_qk, _rope_freqs, _storage_type)
from llmopt.quant.layerwise import MethodOptions, part_slice, quantize_decoder_layer, site_of
from llmopt.quant.quantize import QuantizeRequest, hf_state_dict, quantize
from llmopt.quant.quantizer import QuantScheme

TEXT = ("Rivers run to the sea, and the sea does not fill; the wind goes round and round again. "
        "The quick brown fox jumps over the lazy dog, and numbers became the language of secrets. ") * 12


# ---- the in-memory export, as llmopt wrote GGUF files before it streamed them ------------
def in_memory_gguf(out: Path, config: dict, tensors: dict[str, torch.Tensor], tokenizer, gguf_type: str,
                   metadata: dict[str, str]) -> Path:
    """Every tensor quantized in memory, then GGUFWriter's add_tensor + write_tensors_to_file."""
    if gguf_type in K_QUANT_TYPES:
        f16 = out.with_name(out.name + ".f16")
        in_memory_gguf(f16, config, tensors, tokenizer, "F16", metadata)
        _llama_cpp_quantize(f16, out, gguf_type)
        return out
    cfg = ModelConfig.from_hf(config)
    target = gguf.GGMLQuantizationType[gguf_type]
    writer = gguf.GGUFWriter(str(out), GGUF_ARCHITECTURES[cfg.model_type])
    _add_model_keys(writer, cfg, gguf_type)
    _add_tokenizer(writer, tokenizer, cfg)
    for key, value in metadata.items():
        writer.add_string(key, value)
    output_name = "token_embd.weight" if cfg.tie_word_embeddings else "output.weight"
    arrays = {}
    rope = _rope_freqs(cfg)
    if rope is not None:
        arrays["rope_freqs.weight"] = rope.numpy()
    for hf_name, tensor in tensors.items():
        name = gguf_tensor_name(hf_name)
        array = tensor.to(torch.float32).numpy()
        if GGUF_ARCHITECTURES[cfg.model_type] == "llama" and name.split(".")[-2] in ("attn_q", "attn_k"):
            array = _permute_qk(array, cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads)
        arrays[name] = np.ascontiguousarray(array)
    for name, array in arrays.items():
        qtype = _storage_type(name, array.shape, target, output_name)
        writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def loaded_model_gguf(model_dir: Path, out: Path, gguf_type: str, method: str = "gguf", calib: Path | None = None,
                      num_samples: int = 8, seq_len: int = 32) -> Path:
    """The whole model loaded (the loader's build, float32); for AWQ quantized layer after layer
    with `quantize_decoder_layer`, keeping the scaled weights before rounding; then exported in memory."""
    source = resolve(str(model_dir))
    loaded = load(str(model_dir), dtype="float32", int4_kernels=False)
    model, config = loaded.model, loaded.config
    tensors = hf_state_dict(model)
    if method == "awq":
        options = MethodOptions(method="awq", scheme=QuantScheme(group_size=32), keep_unrounded=True)
        ids = load_calibration(str(calib), loaded, num_samples, seq_len, 0).input_ids
        x = model.model.embed_tokens(ids.reshape(-1))
        cos, sin = model.model.rotary_emb(torch.arange(seq_len).repeat(num_samples), x.dtype)
        attn = EqualLengthAttention(num_samples, seq_len)
        sites = {}
        for i, layer in enumerate(model.model.layers):
            x, layer_sites = quantize_decoder_layer(config, layer, i, x, cos, sin, attn, options)
            sites |= {s.name: s for s in layer_sites}
        tensors = hf_state_dict(model)  # the norms AWQ rescaled
        for name in list(tensors):
            site = sites.get(site_of(name)) if name.endswith(".weight") else None
            if site is not None:
                tensors[name] = site.unrounded[part_slice(config, name)]
    metadata = {"general.name": out.stem, "llmopt.method": method}
    return in_memory_gguf(out, source.raw_config, tensors, load_tokenizer(source), gguf_type, metadata)


def sharded_bf16_copy(model_dir: Path, dest: Path, max_shard_size: str = "40KB") -> Path:
    """The checkpoint in bfloat16 (as real checkpoints are) and in several safetensors shards."""
    source = CheckpointReader.from_folder(model_dir)
    dest.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors" and f.is_file() and f.name != "model.safetensors.index.json":
            (dest / f.name).write_bytes(f.read_bytes())
    writer = SafetensorsShardWriter(dest, [TensorSpec(n, torch.bfloat16, e.shape) for n, e in source.entries.items()],
                                    max_shard_size)
    for name in source.entries:
        writer.write(name, source.get(name).to(torch.bfloat16))
    writer.close()
    assert len(writer.files) >= 3
    return dest


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def sharded(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = sharded_bf16_copy(tiny_models[kind], root / kind)
        return made[kind]

    return get


CASES = [("llama", "Q4_0"), ("llama", "Q8_0"), ("llama", "Q4_K_M"), ("llama", "F16"), ("llama", "BF16"),
         ("llama-tied-rope-llama3", "Q5_1"), ("qwen2", "Q4_1"), ("mistral", "F32")]


@pytest.mark.parametrize("kind,gguf_type", CASES)
def test_streamed_gguf_equals_the_in_memory_export_byte_for_byte(kind, gguf_type, sharded, tmp_path, monkeypatch):
    if gguf_type in K_QUANT_TYPES:
        pytest.importorskip("llama_cpp")
    monkeypatch.setattr(streaming, "ROWS_PER_CHUNK", 100)  # the embedding table and lm_head arrive in row pieces
    model_dir = sharded(kind)
    out = tmp_path / "streamed" / "m.gguf"
    quantize(QuantizeRequest(model=str(model_dir), output=out, method="gguf", gguf_type=gguf_type))
    (tmp_path / "reference").mkdir()
    reference = loaded_model_gguf(model_dir, tmp_path / "reference" / "m.gguf", gguf_type)
    assert out.read_bytes() == reference.read_bytes()
    stored = {t.tensor_type for t in gguf.GGUFReader(str(out)).tensors}
    if gguf_type not in K_QUANT_TYPES:  # (rows of 64 are too short for K blocks: llama.cpp falls back)
        assert gguf.GGMLQuantizationType[gguf_type] in stored


def test_awq_scaled_gguf_equals_the_in_memory_export(sharded, calib_file, tmp_path, monkeypatch):
    monkeypatch.setattr(streaming, "ROWS_PER_CHUNK", 100)
    model_dir = sharded("llama")
    out = tmp_path / "streamed" / "m.gguf"
    quantize(QuantizeRequest(model=str(model_dir), output=out, method="awq", format="gguf", gguf_type="Q4_0",
                             group_size=32, calib=str(calib_file), num_samples=8, seq_len=32))
    (tmp_path / "reference").mkdir()
    reference = loaded_model_gguf(model_dir, tmp_path / "reference" / "m.gguf", "Q4_0", "awq", calib_file)
    assert out.read_bytes() == reference.read_bytes()


# ---- one tensor at a time ---------------------------------------------------------------
class LiveTensors:
    """Bytes of the tensors read from the checkpoint or handed to the GGUF writer that are
    still alive (weak references), their maximum, and the order of reads and writes."""

    def __init__(self):
        self.live: dict[int, int] = {}
        self.peak = 0
        self.events: list[tuple[str, str]] = []

    def track(self, tensor: torch.Tensor) -> None:
        key = id(tensor)
        if key in self.live:
            return
        self.live[key] = tensor.numel() * tensor.element_size()
        weakref.finalize(tensor, self.live.pop, key, None)
        self.peak = max(self.peak, sum(self.live.values()))


@pytest.mark.parametrize("gguf_type", ["Q8_0", "Q4_K_M"])
def test_export_holds_about_one_tensor_at_a_time(gguf_type, tiny_models, tmp_path, monkeypatch):
    if gguf_type in K_QUANT_TYPES:
        pytest.importorskip("llama_cpp")
    model_dir = write_tiny_model(tmp_path / "wide", "llama", vocab_size=2048)  # the embedding: the largest tensor
    monkeypatch.setattr(streaming, "ROWS_PER_CHUNK", 128)
    tracker = LiveTensors()
    get, get_rows, write = CheckpointReader.get, CheckpointReader.get_rows, GGUFTensorWriter.write

    def tracked_get(self, name):
        tensor = get(self, name)
        tracker.track(tensor)
        tracker.events.append(("read", name))
        return tensor

    def tracked_get_rows(self, name, start, stop):
        tensor = get_rows(self, name, start, stop)
        tracker.track(tensor)
        tracker.events.append(("read", name))
        return tensor

    def tracked_write(self, name, tensor, row_start=0):
        tracker.track(tensor)
        tracker.events.append(("write", name))
        return write(self, name, tensor, row_start)

    monkeypatch.setattr(CheckpointReader, "get", tracked_get)
    monkeypatch.setattr(CheckpointReader, "get_rows", tracked_get_rows)
    monkeypatch.setattr(GGUFTensorWriter, "write", tracked_write)
    quantize(QuantizeRequest(model=str(model_dir), output=tmp_path / "m.gguf", method="gguf", gguf_type=gguf_type))

    entries = CheckpointReader.from_folder(model_dir).entries
    model_bytes = sum(e.nbytes for e in entries.values())
    largest_layer_tensor = max(e.nbytes for n, e in entries.items() if ".layers." in n)  # float32 on disk
    chunk = 128 * entries["model.embed_tokens.weight"].shape[1] * 4
    one_tensor = max(largest_layer_tensor, chunk)
    assert model_bytes > 20 * one_tensor  # so that holding a layer, or the model, would show
    assert 0 < tracker.peak <= one_tensor
    # every tensor (or row chunk) read is written before the next is read
    reads = [i for i, (kind, _) in enumerate(tracker.events) if kind == "read"]
    assert len(reads) > 3 * 9 + 2 * 8
    assert all(tracker.events[i + 1] == ("write", tracker.events[i][1]) for i in reads)


def test_writer_refuses_unplanned_misfitting_and_missing_tensors(tiny_models, tmp_path):
    source = resolve(str(tiny_models["llama"]))
    cfg = ModelConfig.from_hf(source.raw_config)
    tokenizer = load_tokenizer(source)
    shapes = {n: e.shape for n, e in CheckpointReader.from_folder(source.path).entries.items()}
    writer = GGUFTensorWriter(tmp_path / "x.gguf", cfg, shapes, tokenizer, "Q8_0", {"general.name": "x"})
    q = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match="not in the GGUF file's plan"):
        writer.write("model.layers.9.mlp.up_proj.weight", torch.zeros(1))
    with pytest.raises(ValueError, match="does not fit"):
        writer.write("model.embed_tokens.weight", torch.zeros(3, 64), row_start=shapes["model.embed_tokens.weight"][0] - 2)
    with pytest.raises(ValueError, match="does not fit"):  # q/k rows are permuted per head: whole tensors only
        writer.write(q, torch.zeros(8, 64))
    writer.write(q, torch.zeros(shapes[q]))
    with pytest.raises(RuntimeError, match="incomplete"):
        writer.close()


def test_a_failed_export_leaves_nothing(tiny_models, tmp_path, monkeypatch):
    def broken(self, name, tensor, row_start=0):
        if ".layers.2." in name:
            raise KeyboardInterrupt
        return write(self, name, tensor, row_start)

    write = GGUFTensorWriter.write
    monkeypatch.setattr(GGUFTensorWriter, "write", broken)
    for gguf_type in ("Q4_0", "Q4_K_M"):
        with pytest.raises(KeyboardInterrupt):
            quantize(QuantizeRequest(model=str(tiny_models["llama"]), output=tmp_path / "m.gguf", method="gguf",
                                     gguf_type=gguf_type))
        assert list(tmp_path.iterdir()) == []
