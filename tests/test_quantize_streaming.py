"""Streaming quantization (one decoder layer in memory at a time): the planned safetensors
writer, outputs equal to quantizing the fully loaded model with the same per-layer function,
sharded inputs and outputs, the memory plan, and the report's memory figures."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from conftest import assert_usage_error, run_cli, write_tiny_model
from llmopt.core.quant_formats import pack_tensors, packed_shapes
from llmopt.core.quantized_weight import QuantizedWeight, QuantScheme
from llmopt.core.weights import INDEX_FILE, CheckpointReader, SafetensorsShardWriter, TensorSpec, save_safetensors
from llmopt.errors import LlmoptError
from llmopt.loader import load
from llmopt.model.attention import EqualLengthAttention
from llmopt.quant import memory_plan
from llmopt.quant.calibration import load_calibration
from llmopt.quant.layerwise import (MethodOptions, checkpoint_tensors, part_slice, quantize_decoder_layer,
                                    quantize_output_layer, site_of)
from llmopt.quant.quantize import QuantizeRequest, quantize

TEXT = ("Rivers run to the sea, and the sea does not fill; the wind goes round and round again. "
        "The quick brown fox jumps over the lazy dog, and numbers became the language of secrets. ") * 12


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


# ---- the planned writer ----------------------------------------------------------------
def random_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "b.weight": torch.randn(7, 5, generator=g),
        "a.scales": torch.randn(3, 8, generator=g).half(),
        "a.qweight": torch.randint(-2**31, 2**31 - 1, (4, 6), generator=g, dtype=torch.int32),
        "c.bf": torch.randn(9, generator=g).bfloat16(),
        "d.long": torch.randint(0, 100, (2, 3), generator=g),
        "e.bytes": torch.randint(0, 255, (13,), generator=g, dtype=torch.uint8),
        "f.mask": torch.rand(5, generator=g) > 0.5,
        "g.int8": torch.randint(-100, 100, (3, 3), generator=g, dtype=torch.int8),
        "h.empty": torch.empty(0, 4),
        "i.double": torch.randn(2, generator=g, dtype=torch.float64),
    }
    return tensors


def write_planned(folder: Path, tensors: dict[str, torch.Tensor], max_shard_size="5GB") -> SafetensorsShardWriter:
    writer = SafetensorsShardWriter(folder, [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()],
                                    max_shard_size)
    names = list(tensors)
    random.Random(1).shuffle(names)  # any order
    for name in names:
        t = tensors[name]
        if t.dim() >= 1 and t.shape[0] >= 2:  # and in row pieces
            writer.write(name, t[1:], row_start=1)
            writer.write(name, t[:1])
        else:
            writer.write(name, t)
    writer.close()
    return writer


def test_planned_file_equals_save_file_byte_for_byte(tmp_path):
    tensors = random_tensors()
    save_safetensors(tensors, tmp_path / "reference.safetensors")
    (tmp_path / "planned").mkdir()
    writer = write_planned(tmp_path / "planned", tensors)
    assert [f.name for f in writer.files] == ["model.safetensors"] and not (tmp_path / "planned" / INDEX_FILE).exists()
    assert (tmp_path / "planned" / "model.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()


def test_shards_split_as_transformers_and_each_equals_save_file(tmp_path):
    from huggingface_hub import split_torch_state_dict_into_shards

    tensors = {f"model.layers.{i}.w": torch.randn(16, 16) for i in range(5)} | {"model.norm.weight": torch.randn(16).half()}
    writer = write_planned(tmp_path, tensors, max_shard_size="2KB")
    expected = split_torch_state_dict_into_shards(tensors, filename_pattern="model{suffix}.safetensors", max_shard_size=2000)
    assert expected.is_sharded and writer.weight_map == expected.tensor_to_filename
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["weight_map"] == expected.tensor_to_filename
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for filename, names in expected.filename_to_tensors.items():
        save_safetensors({n: tensors[n] for n in names}, tmp_path / "ref.safetensors")
        assert (tmp_path / filename).read_bytes() == (tmp_path / "ref.safetensors").read_bytes(), filename
    reader = CheckpointReader.from_folder(tmp_path)
    assert all(torch.equal(reader.get(n), t) for n, t in tensors.items())


def test_writer_refuses_unplanned_misfitting_and_missing_tensors(tmp_path):
    writer = SafetensorsShardWriter(tmp_path, [TensorSpec("a", torch.float16, (4, 2)), TensorSpec("b", torch.int32, (3,))])
    with pytest.raises(ValueError, match="not in the checkpoint's plan"):
        writer.write("c", torch.zeros(1))
    with pytest.raises(ValueError, match="does not fit"):
        writer.write("a", torch.zeros(4, 2))  # float32, planned float16
    with pytest.raises(ValueError, match="does not fit"):
        writer.write("a", torch.zeros(3, 2, dtype=torch.float16), row_start=2)
    writer.write("a", torch.zeros(4, 2, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="incomplete.*'b'"):
        writer.close()


def test_bad_max_shard_size_is_a_usage_error(tiny_models, tmp_path):
    assert_usage_error(["quantize", str(tiny_models["llama"]), "-o", str(tmp_path / "o"), "--method", "rtn",
                        "--group-size", "32", "--max-shard-size", "lots"], "--max-shard-size", "5GB")


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
@pytest.mark.parametrize("out_features, in_features, group_size", [(64, 128, 32), (24, 64, -1)])
def test_packed_shapes_are_what_pack_tensors_writes(fmt, out_features, in_features, group_size):
    scheme = QuantScheme(group_size=group_size)
    groups = scheme.groups_of(in_features)
    q = QuantizedWeight(codes=torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8),
                        scales=torch.rand(out_features, groups), zeros=torch.randint(1, 16, (out_features, groups)),
                        g_idx=torch.arange(in_features, dtype=torch.int32) // scheme.group_width(in_features), scheme=scheme)
    packed = pack_tensors(fmt, "p", q)
    assert packed_shapes(fmt, "p", out_features, in_features, scheme) == {
        name: (t.dtype, tuple(t.shape)) for name, t in packed.items()}


# ---- streaming == the fully loaded model, quantized with the same per-layer function --------
def reference_checkpoint(model_dir: Path, calib: Path, out: Path, method: str, fmt: str, scheme: QuantScheme,
                         desc_act: bool = False, quantize_lm_head: bool = False, num_samples=8, seq_len=32) -> Path:
    """The fully loaded model (the loader's build), quantized layer after layer with
    `quantize_decoder_layer`, packed, and written with safetensors' own `save_file`."""
    loaded = load(str(model_dir), dtype="float32", int4_kernels=False)
    model, config = loaded.model, loaded.config
    options = MethodOptions(method=method, scheme=scheme, desc_act=desc_act)
    if quantize_lm_head and config.tie_word_embeddings:
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone(), requires_grad=False)
    x = cos = sin = attn = None
    if method != "rtn":
        ids = load_calibration(str(calib), loaded, num_samples, seq_len, 0).input_ids
        x = model.model.embed_tokens(ids.reshape(-1))
        cos, sin = model.model.rotary_emb(torch.arange(seq_len).repeat(num_samples), x.dtype)
        attn = EqualLengthAttention(num_samples, seq_len)
    sites = []
    for i, layer in enumerate(model.model.layers):
        x, layer_sites = quantize_decoder_layer(config, layer, i, x, cos, sin, attn, options)
        sites += layer_sites
    if quantize_lm_head:
        sites.append(quantize_output_layer(config, model.model.norm, model.lm_head, x, options))
    by_site = {s.name: s for s in sites}
    tensors = {}
    for name, t in checkpoint_tensors(config, model).items():
        if name == "lm_head.weight" and config.tie_word_embeddings and not quantize_lm_head:
            continue
        site = by_site.get(site_of(name)) if name.endswith(".weight") else None
        if site is None:
            tensors[name] = t.half()
            continue
        q, rows = site.weight, part_slice(config, name)
        tensors.update(pack_tensors(fmt, name[: -len(".weight")], QuantizedWeight(
            codes=q.codes[rows], scales=q.scales[rows], zeros=q.zeros[rows], g_idx=q.g_idx, scheme=q.scheme)))
    out.mkdir(parents=True)
    save_safetensors(tensors, out / "model.safetensors")
    return out / "model.safetensors"


CASES = {
    "rtn": ("llama", dict(method="rtn")),
    "awq": ("llama", dict(method="awq")),
    "gptq": ("llama", dict(method="gptq", desc_act=False)),
    "gptq-act-order": ("llama", dict(method="gptq", desc_act=True, sym=True)),
    "awq-tied-lm-head": ("qwen2-264", dict(method="awq", quantize_lm_head=True)),
    "gptq-mistral-g-1": ("mistral", dict(method="gptq", group_size=-1)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_streaming_equals_the_loaded_model_quantized_layer_by_layer(case, tiny_models, calib_file, tmp_path):
    kind, kw = CASES[case]
    model_dir = write_tiny_model(tmp_path / kind, "qwen2", vocab_size=264) if kind == "qwen2-264" else tiny_models[kind]
    base = dict(group_size=32, calib=str(calib_file), num_samples=8, seq_len=32, seed=0)
    req = QuantizeRequest(model=str(model_dir), output=tmp_path / "streamed", **{**base, **kw})
    quantize(req)
    reference = reference_checkpoint(model_dir, calib_file, tmp_path / "reference", req.method, req.resolved_format(),
                                     req.scheme(), req.resolved_desc_act(), req.quantize_lm_head)
    assert (req.output / "model.safetensors").read_bytes() == reference.read_bytes()


def test_sharded_input_and_output(tiny_models, calib_file, tmp_path):
    """A checkpoint in several shards streams like the single file; a small --max-shard-size
    writes shards with an index that llmopt (and transformers' naming) reads back."""
    source = CheckpointReader.from_folder(tiny_models["llama"])
    sharded = tmp_path / "sharded-source"
    sharded.mkdir()
    for f in tiny_models["llama"].iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            (sharded / f.name).write_bytes(f.read_bytes())
    writer = SafetensorsShardWriter(sharded, [TensorSpec(n, e.dtype, e.shape) for n, e in source.entries.items()], "40KB")
    for name in source.entries:
        writer.write(name, source.get(name))
    writer.close()
    assert len(writer.files) >= 3
    base = dict(group_size=32, calib=str(calib_file), num_samples=8, seq_len=32, method="gptq")
    single = quantize(QuantizeRequest(model=str(tiny_models["llama"]), output=tmp_path / "single", **base))
    report = quantize(QuantizeRequest(model=str(sharded), output=tmp_path / "shards", max_shard_size="30KB", **base))
    out = tmp_path / "shards"
    index = json.loads((out / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(f.name for f in out.glob("*.safetensors")) == files
    assert report.size_after_bytes == sum(f.stat().st_size for f in out.glob("*.safetensors")) > single.size_after_bytes
    a, b = CheckpointReader.from_folder(tmp_path / "single"), CheckpointReader.from_folder(out)
    assert set(a.entries) == set(b.entries) and all(torch.equal(a.get(n), b.get(n)) for n in a.entries)
    loaded = load(str(out), int4_kernels=False)
    assert loaded.config.num_hidden_layers == 3


def test_report_has_peak_rss_layer_times_and_memory_plan(tiny_models, tmp_path):
    report = quantize(QuantizeRequest(model=str(tiny_models["llama"]), output=tmp_path / "o", method="rtn", group_size=32))
    doc = json.loads((tmp_path / "o" / "quantize_report.json").read_text())
    assert doc["peak_rss_bytes"] == report.peak_rss_bytes > 50 * 2**20  # ru_maxrss: at least torch is resident
    assert len(doc["layer_seconds"]) == 3 and all(s >= 0 for s in doc["layer_seconds"])
    assert len(doc["layer_cpu_seconds"]) == 3 and sum(doc["layer_cpu_seconds"]) > 0
    assert doc["memory_plan"]["needed_bytes"] > 0 and doc["parameters"]["dtype"] == "float32"


def test_bfloat16_compute_quantizes_close_to_float32(tiny_models, calib_file, tmp_path):
    base = dict(model=str(tiny_models["llama"]), group_size=32, calib=str(calib_file), num_samples=8, seq_len=32,
                method="gptq")
    quantize(QuantizeRequest(output=tmp_path / "f32", **base))
    quantize(QuantizeRequest(output=tmp_path / "bf16", dtype="bfloat16", **base))
    a = load(str(tmp_path / "f32"), int4_kernels=False).model
    b = load(str(tmp_path / "bf16"), int4_kernels=False).model
    wa, wb = a.model.layers[2].mlp.down_proj.weight, b.model.layers[2].mlp.down_proj.weight
    assert not torch.equal(wa, wb)  # really computed in another dtype
    assert (wa - wb).norm() / wa.norm() < 0.2


# ---- the memory plan ---------------------------------------------------------------------
def test_memory_plan_refuses_early_with_both_numbers(tiny_models, calib_file, tmp_path, monkeypatch):
    monkeypatch.setattr(memory_plan, "available_memory", lambda: 100 * 2**20)
    monkeypatch.delenv("LLMOPT_MEMORY_CHECK", raising=False)
    out = tmp_path / "out"
    line = assert_usage_error(["quantize", str(tiny_models["llama"]), "-o", str(out), "--method", "awq",
                               "--group-size", "32"], "needs about", "available: 0.1 GiB", "--calib")
    assert "GiB" in line.split("needs about")[1].split(";")[0]
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("LLMOPT_MEMORY_CHECK", "0")
    code, err, _ = run_cli("quantize", str(tiny_models["llama"]), "-o", str(out), "--method", "rtn", "--group-size", "32")
    assert code == 0, err


def test_memory_plan_of_an_8b_model(monkeypatch):
    """The estimate scales as the streaming path does: one layer and the activations, not the model."""
    from llmopt.core.config import ModelConfig

    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
                               "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                               "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
                               "rms_norm_eps": 1e-5, "tie_word_embeddings": False})
    assert 7.9e9 < cfg.num_parameters < 8.1e9
    gib = 2**30
    rtn = memory_plan.quantize_plan(cfg, "rtn", "gptq", 64, 256, torch.float32, False, False)
    awq = memory_plan.quantize_plan(cfg, "awq", "awq", 64, 256, torch.float32, False, False)
    awq_bf16 = memory_plan.quantize_plan(cfg, "awq", "awq", 64, 256, torch.bfloat16, False, False)
    awq_self = memory_plan.quantize_plan(cfg, "awq", "awq", 64, 256, torch.float32, True, False)
    assert rtn.needed < 4 * gib and awq_bf16.needed < awq.needed < 12 * gib  # the fp32 model alone is 30 GiB
    assert awq_self.needed > 32 * gib  # --calib self loads the whole model in float32
    gptq = memory_plan.quantize_plan(cfg, "gptq", "gptq", 64, 256, torch.float32, False, False)
    assert gptq.parts["hessian"] == 2 * 14336**2 * 4 and "hessian" not in awq.parts  # down_proj's H and its factor
    assert abs(gptq.needed - awq.needed - gptq.parts["hessian"] * memory_plan.HEADROOM) <= 1
    monkeypatch.setattr(memory_plan, "available_memory", lambda: 16 * gib)
    monkeypatch.delenv("LLMOPT_MEMORY_CHECK", raising=False)
    memory_plan.check_fits(awq, "quantize", "hint")
    with pytest.raises(LlmoptError, match=r"needs about 3\d\.\d GiB \(GiB: model for --calib self 29\.9.* available: 16\.0 GiB.*; hint"):
        memory_plan.check_fits(awq_self, "quantize", "hint")


def test_memory_plan_of_gguf_export_is_one_tensor_or_llama_cpps_phase(tiny_models, tmp_path, monkeypatch):
    """GGUF export streams: the plan is one tensor (no layer, no model) for the types quantized
    in Python; the K-quants add llama.cpp's phase (its largest tensor in float32, twice)."""
    from llmopt.core.config import ModelConfig

    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
                               "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                               "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
                               "rms_norm_eps": 1e-5, "tie_word_embeddings": False})
    gib = 2**30

    def plan(method, fmt, gguf_type):
        return memory_plan.quantize_plan(cfg, method, fmt, 64, 256, torch.float32, False, False, gguf_type=gguf_type)

    q4_0, q4_k_m, awq_q4_0 = plan("gguf", "gguf", "Q4_0"), plan("gguf", "gguf", "Q4_K_M"), plan("awq", "gguf", "Q4_0")
    rtn = memory_plan.quantize_plan(cfg, "rtn", "gptq", 64, 256, torch.float32, False, False)
    tensor = 14336 * 4096 * 8  # gate/up/down in float32 + a permuted or quantized copy
    assert q4_0.parts == {"interpreter": memory_plan.BASELINE_BYTES, "tensor": tensor}  # no layer, no model
    assert q4_0.needed < 1.5 * gib < rtn.needed  # the fp32 model alone is 30 GiB
    llama_cpp = q4_k_m.parts["llama.cpp Q4_K_M of the largest tensor"]
    assert llama_cpp == 128256 * 4096 * 10 and q4_k_m.needed == int((memory_plan.BASELINE_BYTES + llama_cpp) * 1.15)
    assert awq_q4_0.parts["unrounded weights"] > 0 and awq_q4_0.needed > plan("awq", "awq", None).needed
    # refused before any weight is read, with the reason where llama.cpp's phase is the peak
    monkeypatch.setattr(memory_plan, "available_memory", lambda: 100 * 2**20)
    monkeypatch.delenv("LLMOPT_MEMORY_CHECK", raising=False)
    out = tmp_path / "m.gguf"
    assert_usage_error(["quantize", str(tiny_models["llama"]), "-o", str(out), "--method", "gguf",
                        "--gguf-type", "Q4_K_M"], "needs about", "llama.cpp", "Q4_0")
    assert_usage_error(["quantize", str(tiny_models["llama"]), "-o", str(out), "--method", "gguf",
                        "--gguf-type", "Q8_0"], "needs about", "one tensor at a time")
    assert list(tmp_path.iterdir()) == []


def test_available_memory_is_read():
    available = memory_plan.available_memory()
    assert available is None or 0 < available < 2**50
