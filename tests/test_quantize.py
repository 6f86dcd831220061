"""`llmopt quantize` on tiny random-weight models: calibration, RTN / AWQ / GPTQ, checkpoints
that load back, reports, and bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import assert_usage_error, read_config, run_cli
from llmopt.loader import load
from llmopt.errors import LlmoptError
from llmopt.eval.metrics.textscore import kl_divergence
from llmopt.quant.calibration import load_calibration
from llmopt.quant.quantize import QuantizeRequest, hf_state_dict, quantize

TEXT = (
    "The quick brown fox jumps over the lazy dog. In the beginning the theory of numbers was a game; "
    "then it became the language of cryptography, which protects the messages we send every day. "
    "Rivers run to the sea, and the sea does not fill; the wind goes round and round again. "
) * 12


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def request(model: Path, out: Path, calib: Path, **kw) -> QuantizeRequest:
    base = dict(group_size=32, calib=str(calib), num_samples=8, seq_len=32, seed=0)
    return QuantizeRequest(model=str(model), output=out, **{**base, **kw})


@pytest.fixture(scope="module")
def quantized(tiny_models, calib_file, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantized")
    outs = {}
    for name, kw in {"rtn": dict(method="rtn"), "awq": dict(method="awq"), "gptq": dict(method="gptq", desc_act=False),
                     "gptq-act": dict(method="gptq", desc_act=True, sym=True), "gptq-g-1": dict(method="gptq", group_size=-1),
                     "awq-as-gptq": dict(method="awq", format="gptq")}.items():
        outs[name] = root / name
        quantize(request(tiny_models["llama"], outs[name], calib_file, **kw))
    return outs


def test_calibration_is_deterministic_per_seed(tiny_models, calib_file):
    model = load(str(tiny_models["llama"]))
    a = load_calibration(str(calib_file), model, 8, 32, seed=1).input_ids
    b = load_calibration(str(calib_file), model, 8, 32, seed=1).input_ids
    c = load_calibration(str(calib_file), model, 8, 32, seed=2).input_ids
    assert a.shape == (8, 32) and torch.equal(a, b) and not torch.equal(a, c)


def test_calibration_file_kinds_and_errors(tiny_models, tmp_path):
    model = load(str(tiny_models["llama"]))
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": TEXT[i * 200:(i + 1) * 200]}) for i in range(10)), encoding="utf-8")
    assert load_calibration(str(jsonl), model, 4, 32, 0).input_ids.shape == (4, 32)
    with pytest.raises(LlmoptError, match="too short"):
        load_calibration(str(jsonl), model, 1000, 32, 0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"content": "no text field"}\n', encoding="utf-8")
    with pytest.raises(LlmoptError, match="'text'"):
        load_calibration(str(bad), model, 1, 8, 0)
    empty = tmp_path / "empty.txt"
    empty.write_text("   ", encoding="utf-8")
    with pytest.raises(LlmoptError, match="empty"):
        load_calibration(str(empty), model, 1, 8, 0)
    with pytest.raises(LlmoptError, match="does not exist"):
        load_calibration(str(tmp_path / "missing.txt"), model, 1, 8, 0)
    with pytest.raises(LlmoptError, match="cannot load calibration dataset"):
        load_calibration("hf:no-such/dataset", model, 1, 8, 0)  # offline in tests


def test_self_calibration_generates_its_own_samples(tiny_models):
    model = load(str(tiny_models["llama"]))
    data = load_calibration("self", model, 3, 16, seed=0)
    assert data.input_ids.shape == (3, 16) and data.num_documents == 3
    assert torch.equal(data.input_ids, load_calibration("self", model, 3, 16, seed=0).input_ids)


@pytest.mark.parametrize("name", ["rtn", "awq", "gptq", "gptq-act", "gptq-g-1", "awq-as-gptq"])
def test_checkpoint_layout_config_and_report(quantized, name):
    out = quantized[name]
    config = read_config(out)
    qc = config["quantization_config"]
    fmt = "awq" if name == "awq" else "gptq"
    assert qc["quant_method"] == fmt and qc["bits"] == 4
    assert qc["group_size"] == (-1 if name == "gptq-g-1" else 32)
    if fmt == "gptq":
        assert qc["checkpoint_format"] == "gptq" and qc["desc_act"] == (name in ("gptq-act", "gptq-g-1"))
        assert qc["sym"] == (name == "gptq-act")
    else:
        assert qc["version"] == "gemm" and qc["zero_point"] is True
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        qweight = f.get_tensor("model.layers.0.mlp.down_proj.qweight")
        scales = f.get_tensor("model.layers.0.mlp.down_proj.scales")
    for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
        assert f"model.layers.1.{proj}.qweight" in names and f"model.layers.1.{proj}.weight" not in names
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names  # unquantized by default
    assert scales.dtype == torch.float16 and qweight.dtype == torch.int32
    # down_proj: in 128, out 64
    assert tuple(qweight.shape) == ((128, 8) if fmt == "awq" else (16, 64))
    report = json.loads((out / "quantize_report.json").read_text())
    assert report["method"] == name.split("-")[0] and report["format"] == fmt
    assert report["size_after_bytes"] > 0 and report["peak_rss_bytes"] > 0 and report["wall_seconds"] > 0
    assert len(report["layers"]) == 3 * 4
    if report["method"] != "rtn":
        assert report["calibration"]["num_samples"] == 8 and report["calibration"]["seq_len"] == 32
        assert all(0 <= layer["relative_error"] < 1 for layer in report["layers"])


def test_act_order_checkpoint_has_permuted_groups(quantized):
    from safetensors import safe_open

    with safe_open(str(quantized["gptq-act"] / "model.safetensors"), "pt") as f:
        g_idx = f.get_tensor("model.layers.0.mlp.down_proj.g_idx")
    assert sorted(torch.bincount(g_idx).tolist()) == [32] * 4
    assert not torch.equal(g_idx, torch.arange(128, dtype=torch.int32) // 32)


@pytest.mark.parametrize("name", ["rtn", "awq", "gptq", "gptq-act"])
def test_loaded_weights_equal_the_quantizers_weights(tiny_models, calib_file, tmp_path, name):
    """What llmopt loads from the checkpoint is exactly the grid the quantizer chose."""
    kw = {"rtn": dict(method="rtn"), "awq": dict(method="awq"), "gptq": dict(method="gptq"),
          "gptq-act": dict(method="gptq", desc_act=True)}[name]
    from llmopt.quant import streaming
    from llmopt.quant.layerwise import checkpoint_tensors

    captured = {}
    original = streaming._emit

    def capture(sink, config, module, prefix, sites, fmt, dense_dtype):  # each module as it is written
        captured.update({k: v.clone() for k, v in checkpoint_tensors(config, module, prefix).items()})
        return original(sink, config, module, prefix, sites, fmt, dense_dtype)

    streaming._emit = capture
    try:
        out = quantize(request(tiny_models["llama"], tmp_path / name, calib_file, **kw)).output
    finally:
        streaming._emit = original
    loaded = hf_state_dict(load(out, int4_kernels=False).model)
    assert len(captured) == 3 * 9  # every decoder layer's tensors: 7 projections, 2 norms
    for key, expected in captured.items():
        tol = 0 if key.endswith(("proj.weight",)) else 1e-3  # other tensors were stored as fp16
        assert torch.allclose(loaded[key], expected, atol=tol, rtol=tol), key


def kld_to_base(tiny_models, out: Path) -> float:
    base = load(str(tiny_models["llama"]))
    ids = torch.tensor(base.tokenizer.encode(TEXT[:1500], add_special_tokens=False))
    return kl_divergence(base.model, load(str(out)).model, ids, ctx_size=64).mean  # llama.cpp's windowing


def test_calibrated_methods_beat_round_to_nearest(tiny_models, quantized):
    rtn = kld_to_base(tiny_models, quantized["rtn"])
    assert 0 < rtn
    assert kld_to_base(tiny_models, quantized["gptq"]) < rtn
    assert kld_to_base(tiny_models, quantized["awq"]) < rtn
    assert kld_to_base(tiny_models, quantized["gptq-act"]) < rtn


def test_quantized_model_generates(quantized):
    from llmopt.runtime import LLM, SamplingParams

    out = LLM(str(quantized["awq"])).generate(["the quick brown"], SamplingParams(max_tokens=8, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 8


def test_quantize_lm_head_unties_and_packs_it(tiny_models, calib_file, tmp_path):
    from conftest import write_tiny_model

    with pytest.raises(LlmoptError, match="vocabulary size 263 is not a multiple of 8"):
        quantize(request(tiny_models["qwen2"], tmp_path / "odd-vocab", calib_file, method="gptq", quantize_lm_head=True))
    model = write_tiny_model(tmp_path / "qwen2-264", "qwen2", vocab_size=264)
    out = tmp_path / "qwen2-lm-head"
    quantize(request(model, out, calib_file, method="gptq", quantize_lm_head=True))
    config = read_config(out)
    assert config["tie_word_embeddings"] is False and config["quantization_config"]["lm_head"] is True
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.qweight" in f.keys() and "model.embed_tokens.weight" in f.keys()
    dense = load(str(out), int4_kernels=False)
    assert dense.model.lm_head.weight is not dense.model.model.embed_tokens.weight
    from llmopt.kernels.cpu_int4 import int4_linear_kernel
    from llmopt.model.int4_linear import CpuInt4Linear

    if int4_linear_kernel() is not None:  # the quantized vocabulary projection runs on the int4 kernel too
        assert isinstance(load(str(out)).model.lm_head, CpuInt4Linear)
    assert math.isfinite(kld_to_base({"llama": model}, out))


def test_gguf_outputs_and_report_beside(tiny_models, calib_file, tmp_path):
    out = tmp_path / "tiny.gguf"
    code, err, stdout = run_cli("quantize", str(tiny_models["llama"]), "-o", str(out), "--method", "gguf",
                                "--gguf-type", "Q8_0", "--json")
    assert code == 0, err
    report = json.loads(stdout)
    assert report["format"] == "gguf" and report["parameters"]["gguf_type"] == "Q8_0"
    assert out.exists() and (tmp_path / "tiny.gguf.quantize_report.json").exists()
    assert load(str(out)).config.num_hidden_layers == 3
    awq_gguf = tmp_path / "awq.gguf"
    quantize(request(tiny_models["llama"], awq_gguf, calib_file, method="awq", format="gguf", gguf_type="F16"))
    down = load(str(awq_gguf)).model.model.layers[0].mlp.down_proj.weight
    # AWQ-scaled weights are exported before rounding (GGUF's types round them): not on a 16-level grid
    assert len(torch.unique(down[0, :32])) > 16


def test_cli_quantize_prints_report(tiny_models, calib_file, tmp_path):
    out = tmp_path / "cli-gptq"
    code, err, stdout = run_cli("quantize", str(tiny_models["llama"]), "-o", str(out), "--method", "gptq",
                                "--group-size", "32", "--calib", str(calib_file), "--num-samples", "4", "--seq-len", "16")
    assert code == 0, err
    assert "gptq" in stdout and "peak RSS" in stdout and (out / "quantize_report.json").exists()


@pytest.mark.parametrize("args, fragments", [
    (["--group-size", "48"], ["--group-size 48", "does not divide", "32"]),
    (["--bits", "3"], ["--bits 3"]),
    (["--method", "smoothquant"], ["unknown method", "awq"]),
    (["--format", "exl2"], ["unknown format"]),
    (["--method", "gguf", "--gguf-type", "Q3_XYZ"], ["unknown GGUF type", "Q4_K_M"]),
    (["--method", "awq", "--group-size", "-1"], ["AWQ format", "--format gptq"]),
    (["--method", "awq", "--desc-act"], ["--desc-act"]),
    (["--calib", "/no/such/file.txt", "--method", "gptq"], ["does not exist"]),
    (["--num-samples", "0", "--method", "gptq"], ["--num-samples"]),
])
def test_bad_flags_exit_2_and_write_nothing(tiny_models, tmp_path, calib_file, args, fragments):
    out = tmp_path / "out"
    full = ["quantize", str(tiny_models["llama"]), "-o", str(out), "--calib", str(calib_file), "--group-size", "32", *args]
    assert_usage_error(full, *fragments)
    assert list(tmp_path.iterdir()) == []


def test_existing_output_and_already_quantized(tiny_models, quantized, tmp_path, calib_file):
    existing = tmp_path / "exists"
    existing.mkdir()
    assert_usage_error(["quantize", str(tiny_models["llama"]), "-o", str(existing), "--method", "rtn", "--group-size", "32"],
                       "already exists", "--overwrite")
    assert_usage_error(["quantize", str(quantized["awq"]), "-o", str(tmp_path / "again"), "--method", "rtn",
                        "--group-size", "32"], "already quantized")
    code, err, _ = run_cli("quantize", str(tiny_models["llama"]), "-o", str(existing), "--method", "rtn",
                           "--group-size", "32", "--overwrite")
    assert code == 0, err and (existing / "config.json").exists()


def test_interrupt_midway_leaves_nothing(tiny_models, calib_file, tmp_path, monkeypatch):
    from llmopt.quant import streaming

    real = streaming.quantize_decoder_layer

    def interrupted(config, layer, index, *args):
        if index == 2:
            raise KeyboardInterrupt
        return real(config, layer, index, *args)

    monkeypatch.setattr(streaming, "quantize_decoder_layer", interrupted)
    out = tmp_path / "out"
    code, err, _ = run_cli("quantize", str(tiny_models["llama"]), "-o", str(out), "--method", "gptq", "--group-size", "32",
                           "--calib", str(calib_file), "--num-samples", "4", "--seq-len", "16")
    lines = err.strip().splitlines()
    assert code == 2 and lines[-1].startswith("error: interrupted") and "Traceback" not in err
    assert all(line.startswith("llmopt: ") for line in lines[:-1])  # the memory plan and progress lines before it
    assert list(tmp_path.iterdir()) == []


def test_sigterm_midway_leaves_nothing(tiny_models, tmp_path):
    """`kill` (SIGTERM: what `timeout` and CI runners send) ends a quantize run as Ctrl-C does: one
    error line, and no temporary folder left beside the output. The run is held inside its second
    layer (a patched layer that sleeps) until the signal comes."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "out"
    script = ("import sys, time; from llmopt.quant import streaming; real = streaming.quantize_decoder_layer\n"
              "def held(config, layer, index, *args):\n"
              "    if index == 1: time.sleep(120)\n"
              "    return real(config, layer, index, *args)\n"
              "streaming.quantize_decoder_layer = held\n"
              "from llmopt.cli.main import main; sys.argv[0] = 'llmopt'; main()")
    proc = subprocess.Popen([sys.executable, "-c", script, "quantize", str(tiny_models["llama"]), "-o", str(out),
                             "--method", "rtn", "--group-size", "32"], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not any(".tmp-" in p.name for p in tmp_path.iterdir()) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # inside the held layer
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    lines = err.strip().splitlines()
    assert proc.returncode == 2 and lines[-1].startswith("error: interrupted") and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["awq", "gptq-act", "gptq-g-1"])
def test_bf16_load_runs_the_cpu_int4_kernel(quantized, name):
    """bf16 models run AWQ/GPTQ layers on PyTorch's CPU int4 kernel; outputs match the dequantized weights."""
    from llmopt.model.attention import EqualLengthAttention
    from llmopt.model.int4_linear import Int4Linear

    kernel = load(str(quantized[name]), dtype="bfloat16")
    layers = [m for m in kernel.model.modules() if isinstance(m, Int4Linear)]
    assert len(layers) == 3 * 4  # every fused projection of the 3 layers
    if name == "gptq-act":
        assert all(m.perm is not None for m in layers)
    dense = load(str(quantized[name]), dtype="float32", int4_kernels=False)
    for (_, a), (_, b) in zip([(n, m) for n, m in kernel.model.named_modules() if isinstance(m, Int4Linear)],
                              [(n, m) for n, m in dense.model.named_modules() if n.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))]):
        xin = torch.randn(5, a.in_features)
        assert torch.allclose(a(xin.bfloat16()).float(), b(xin), atol=0.05 * b(xin).abs().max().item())
    ids = torch.tensor(dense.tokenizer.encode("the quick brown fox", add_special_tokens=False))
    positions = torch.arange(len(ids))
    logits_kernel = kernel.model.compute_logits(kernel.model(ids, positions, EqualLengthAttention(1, len(ids))))
    logits_dense = dense.model.compute_logits(dense.model(ids, positions, EqualLengthAttention(1, len(ids))))
    assert (logits_kernel.argmax(-1) == logits_dense.argmax(-1)).float().mean() >= 0.75
