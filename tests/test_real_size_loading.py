"""Loading without dense copies and without checkpoints: AWQ / GPTQ projections go from their
packed tensors straight to the int4 kernel's layout (never a dense weight), and
`--load-format dummy` / `models convert --load-format dummy` give random weights of a model's
shape (shipped architectures included)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import TINY_CONFIGS, assert_usage_error, run_cli, write_tiny_int4_checkpoints
from llmopt.core.config import ModelConfig
from llmopt.core.dummy import INIT_STD, DummyWeights, checkpoint_shapes
from llmopt.core.quant_formats import unpack_tensors
from llmopt.core.quantized_weight import QuantizedWeight
from llmopt.core.source import resolve
from llmopt.core.weights import INDEX_FILE, CheckpointReader
from llmopt.kernels.cpu_int4 import repack_int8
from llmopt.loader import load
from llmopt.model.int4_linear import CpuInt4Linear, Int4Linear, cpu_int4_linear
from llmopt.model.llama import checkpoint_names


@pytest.fixture(scope="module")
def int4_checkpoints(tiny_models, tmp_path_factory) -> dict[str, Path]:
    return write_tiny_int4_checkpoints(tmp_path_factory.mktemp("int4"), {
        "awq-rtn": (tiny_models["qwen2"], dict(method="rtn")),
        "gptq-act": (tiny_models["llama"], dict(method="gptq", desc_act=True, sym=True)),
        "gptq-g-1": (tiny_models["llama"], dict(method="gptq", group_size=-1))})


@pytest.mark.parametrize("name", ["awq-rtn", "gptq-act", "gptq-g-1"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int4_checkpoint_loads_without_a_dense_projection(int4_checkpoints, monkeypatch, name, dtype):
    """Every projection of an int4 checkpoint becomes the CPU backend's int4 layer, and no dense
    weight is made on the way (dequantizing any grid fails the test)."""
    def no_dense(self):
        raise AssertionError("a projection was dequantized while loading")

    monkeypatch.setattr(QuantizedWeight, "dequantize", no_dense)
    loaded = load(str(int4_checkpoints[name]), dtype=dtype)
    layer_type = CpuInt4Linear if dtype == "float32" else Int4Linear
    layers = {n: m for n, m in loaded.model.named_modules() if isinstance(m, layer_type)}
    assert len(layers) == 3 * 4, sorted(layers)  # q/k/v, o, gate/up, down of 3 layers


def test_int4_layers_hold_the_kernel_layout_of_the_checkpoint(int4_checkpoints):
    """Each loaded int4 layer equals the kernel layer built from the checkpoint's packed tensors
    directly (the projections joined as the decoder stacks them), buffer for buffer."""
    folder = int4_checkpoints["gptq-act"]
    loaded = load(str(folder), dtype="float32")
    reader = CheckpointReader.from_folder(folder)
    checked = 0
    for module_name, module in loaded.model.named_modules():
        if not isinstance(module, CpuInt4Linear):
            continue
        parts = [p.removesuffix(".weight") for p in checkpoint_names(f"{module_name}.weight")]
        qs = [unpack_tensors("gptq", {k: reader.get(k) for k in reader.names() if k.startswith(p + ".")}, p, 4, 32)
              for p in parts]
        joined = QuantizedWeight(codes=torch.cat([q.codes for q in qs]), scales=torch.cat([q.scales for q in qs]),
                                 zeros=torch.cat([q.zeros for q in qs]), g_idx=qs[0].g_idx, scheme=qs[0].scheme)
        direct = cpu_int4_linear(joined, None)
        got, want = dict(module.named_buffers()), dict(direct.named_buffers())
        assert got.keys() == want.keys() and got
        for key in want:
            assert torch.equal(got[key], want[key]), (module_name, key)
        checked += 1
    assert checked == 12


@pytest.mark.parametrize("name", ["awq-rtn", "gptq-act"])  # tied and untied embeddings
def test_int4_model_keeps_its_vocabulary_tables_in_the_checkpoints_16_bits(int4_checkpoints, name):
    """An fp32 int4 model's embedding and output tables stay in the checkpoint's fp16 (half their
    fp32 size; the output projection runs on its int8 copy): the embedding rows it gives and the
    int8 copy equal those of fp32 tables exactly."""
    folder = int4_checkpoints[name]
    model = load(str(folder), dtype="float32").model
    head = model.lm_head
    if head.int8_weight is None:
        pytest.skip("llmopt's CPU kernels are not built here: the output projection keeps fp32 tables")
    reader = CheckpointReader.from_folder(folder)
    table = reader.get("model.embed_tokens.weight")
    assert table.dtype == torch.float16
    assert model.model.embed_tokens.weight.dtype == head.weight.dtype == torch.float16
    assert (head.weight is model.model.embed_tokens.weight) == ("lm_head.weight" not in reader)
    ids = torch.tensor([0, 5, 17, table.shape[0] - 1])
    rows = model.model.embed(ids)
    assert rows.dtype == torch.float32 and torch.equal(rows, table.float()[ids])
    wide = repack_int8(reader.get("lm_head.weight" if "lm_head.weight" in reader else "model.embed_tokens.weight").float())
    assert torch.equal(head.int8_weight.codes, wide.codes) and torch.equal(head.int8_weight.scales, wide.scales)


@pytest.mark.parametrize("kind", sorted(TINY_CONFIGS))
def test_dummy_shapes_are_the_checkpoints_names_and_shapes(tiny_models, kind):
    """`checkpoint_shapes` (what dummy weights and their checkpoints hold) names exactly the tensors
    transformers writes for the config, with their shapes."""
    reader = CheckpointReader.from_folder(tiny_models[kind])
    config = resolve(str(tiny_models[kind])).config
    assert checkpoint_shapes(config) == {name: reader.shape(name) for name in reader.names()}


def test_dummy_weights_are_deterministic_and_distinct(tiny_models):
    config = resolve(str(tiny_models["llama"])).config
    a, b = DummyWeights(config), DummyWeights(config)
    q = a.get("model.layers.0.self_attn.q_proj.weight")
    assert torch.equal(q, b.get("model.layers.0.self_attn.q_proj.weight"))
    assert not torch.equal(q, a.get("model.layers.1.self_attn.q_proj.weight"))
    assert abs(q.float().std().item() - INIT_STD) < 0.2 * INIT_STD
    assert torch.equal(a.get("model.norm.weight"), torch.ones(64, dtype=torch.bfloat16))
    # a tensor longer than the noise block is not one window repeated
    big = ModelConfig(**{**config.to_dict(), "vocab_size": 40_000})
    embed = DummyWeights(big).get("model.embed_tokens.weight").flatten()
    assert not torch.equal(embed[:1_000_003], embed[1_000_003:2_000_006])


def test_convert_dummy_writes_a_sharded_checkpoint_that_loads(tiny_models, tmp_path, monkeypatch):
    from llmopt.core import convert

    config_only = tmp_path / "config-only"
    config_only.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_models["llama"] / name, config_only / name)
    monkeypatch.setattr(convert, "DUMMY_SHARD_BYTES", 40_000)
    out = tmp_path / "dummy"
    code, err, stdout = run_cli("models", "convert", str(config_only), "-o", str(out), "--load-format", "dummy",
                                "--dtype", "bfloat16")
    assert code == 0, err
    index = json.loads((out / INDEX_FILE).read_text())
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == {s.name for s in shards}
    reader = CheckpointReader.from_folder(out)
    config = resolve(str(out)).config
    weights = DummyWeights(config)
    assert sorted(reader.names()) == sorted(weights.names())
    for name in reader.names():
        assert torch.equal(reader.get(name), weights.get(name)), name
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    # the written folder and the config-only folder with --load-format dummy are the same model
    ids = torch.tensor([5, 6, 7, 8])
    from llmopt.model.attention import EqualLengthAttention

    def logits(loaded):
        return loaded.model.compute_logits(loaded.model(ids, torch.arange(4), EqualLengthAttention(1, 4)))

    assert torch.equal(logits(load(str(out), dtype="float32")), logits(load(str(config_only), load_format="dummy")))


def test_generate_with_dummy_weights_and_without(tiny_models, tmp_path):
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_models["llama"] / name, config_only / name)
    code, err, out = run_cli("generate", str(config_only), "--prompt", "the sea", "--max-tokens", "4",
                             "--load-format", "dummy")
    assert code == 0, err
    assert_usage_error(["generate", str(config_only), "--prompt", "x"], "no .safetensors weights")


def test_generate_without_a_prompt_samples_from_bos(tiny_models, tmp_path):
    """`llmopt generate MODEL` with no prompt: one sample from the BOS token alone (transformers'
    generate() without inputs), the way a dummy-weight model is tried out; a model whose tokenizer has
    no BOS token (the tiny models') still needs a prompt."""
    folder = tmp_path / "with-bos"
    shutil.copytree(tiny_models["llama"], folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["bos_token"] = "<|endoftext|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    code, err, out = run_cli("generate", str(folder), "--max-tokens", "4", "--temperature", "0", "--ignore-eos",
                             "--json")
    assert code == 0, err
    (record,) = json.loads(out)["requests"]
    from llmopt.core.tokenizer import Tokenizer

    bos = Tokenizer.from_dir(folder).token_to_id("<|endoftext|>")
    assert bos is not None and record["prompt_token_ids"] == [bos] and record["num_generated_tokens"] == 4
    assert_usage_error(["generate", str(tiny_models["llama"]), "--max-tokens", "4"], "no BOS token")
    empty = tmp_path / "prompts.txt"
    empty.write_text("\n")
    assert_usage_error(["generate", str(folder), "--prompts-file", str(empty)], "holds no prompt")


def test_shipped_architecture_is_a_model_spec_for_dummy_weights():
    code, err, out = run_cli("models", "info", "llama-3-8b", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["kind"] == "architecture"
    arch = doc["architecture"]
    assert (arch["hidden_size"], arch["num_hidden_layers"], arch["num_key_value_heads"]) == (4096, 32, 8)
    assert arch["vocab_size"] == 49152  # the default model's tokenizer, so it runs end to end
    assert_usage_error(["generate", "llama-3-8b", "--prompt", "x"], "--load-format dummy")


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_gguf_q4_0_projections_load_as_int4_layers(tiny_models, tmp_path, kind):
    """A Q4_0 GGUF's projections stay 4-bit: read as grids (llama's q/k rows un-interleaved like
    the dense tensors) that dequantize exactly to what the dense reader gives, and loaded as the
    CPU int4 kernel's layers whose outputs match the dense weights."""
    from llmopt.core.gguf_file import read_gguf
    from llmopt.core.weights import load_safetensors, safetensors_files
    from llmopt.core.tokenizer import Tokenizer
    from llmopt.quant.gguf_export import write_gguf

    folder = tiny_models[kind]
    config = json.loads((folder / "config.json").read_text())
    path = write_gguf(tmp_path / "m.gguf", config, load_safetensors(safetensors_files(folder)),
                      Tokenizer.from_dir(folder), "Q4_0")
    tensors = read_gguf(path).tensors
    grids = {name: tensors.quantized(name) for name in tensors}
    assert sum(g is not None for g in grids.values()) >= 3 * 7  # every projection of the 3 layers
    for name, grid in grids.items():
        if grid is not None:
            assert torch.equal(grid.dequantize(), tensors[name]), name
    kernel, dense = load(str(path), dtype="float32"), load(str(path), dtype="float32", int4_kernels=False)
    layers = {n: m for n, m in kernel.model.named_modules() if isinstance(m, CpuInt4Linear)}
    assert len(layers) >= 3 * 4
    dense_modules = dict(dense.model.named_modules())
    x = torch.randn(3, 64)
    for name, layer in layers.items():
        if layer.in_features == 64:
            want = dense_modules[name](x)
            assert torch.allclose(layer(x), want, atol=0.02 * want.abs().max().item()), name
