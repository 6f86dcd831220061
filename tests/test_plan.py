"""`llmopt plan`: byte counts against hand-computed Llama-3-8B figures, the runtime's own K/V
allocation and the checkpoints `llmopt quantize` writes; placement arithmetic; bad input."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from conftest import assert_usage_error, run_cli
from llmopt.core import resolve
from llmopt.core.architectures import shipped_config
from llmopt.plan.formats import FORMATS, WeightFormat, int4_bits, kv_bytes, kv_bytes_per_token, weight_bytes
from llmopt.plan.hardware import GPUS
from llmopt.plan.planner import OVERHEAD_GIB, PlanRequest, place
from llmopt.quant.quantize import QuantizeRequest, quantize

GIB = 2**30


def test_llama_3_8b_by_hand():
    cfg = shipped_config("llama-3-8b")
    assert cfg.num_parameters == 8_030_261_248  # the published count
    # per layer: q 4096x4096, k and v 4096x1024, o 4096x4096, gate/up/down 3 x 4096x14336
    linear = 32 * (4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336)
    embeddings = 2 * 128256 * 4096  # untied: embedding table + output projection
    norms = 65 * 4096
    assert weight_bytes(cfg, FORMATS["bf16"]) == 2 * (linear + embeddings + norms)
    # AWQ g128: half a byte per weight, per 128 inputs an fp16 scale and a 4-bit zero for each output
    groups = 32 * (4096 // 128 * (4096 + 1024 * 2 + 4096 + 14336 * 2) + 14336 // 128 * 4096)
    assert weight_bytes(cfg, FORMATS["awq-int4-g128"]) == linear // 2 + groups * 2 + groups // 2 \
        + 2 * (embeddings + norms)
    assert kv_bytes_per_token(cfg) == 32 * 2 * 8 * 128 * 2 == 131072
    assert kv_bytes(cfg, 4096) == 4096 * 131072
    mistral = shipped_config("mistral-7b")  # sliding window 4096: a longer context holds no more K/V
    assert kv_bytes(mistral, 16384) == kv_bytes(mistral, 4096) == 4096 * kv_bytes_per_token(mistral)


def test_placement_arithmetic():
    cfg = shipped_config("llama-3-8b")
    req = PlanRequest(context=4096, concurrency=8)
    t4 = place(cfg, "bf16", GPUS["T4"], req)  # 15 GiB of weights > 16 x 0.9 - 1.5 GiB
    assert t4.gpus_needed == 2
    usable = 16 * GIB * 0.9 - OVERHEAD_GIB * GIB
    assert t4.max_concurrency == int((2 * usable - weight_bytes(cfg, FORMATS["bf16"])) // (4096 * 131072))
    h100 = place(cfg, "awq-int4-g128", GPUS["H100-SXM"], req)
    step = weight_bytes(cfg, FORMATS["awq-int4-g128"]) + 8 * 2048 * 131072  # K/V at the mean context
    assert h100.gpus_needed == 1
    assert h100.roofline_tok_s == pytest.approx(8 * 3350e9 / step)
    assert h100.usd_per_million_tokens == pytest.approx(2.50 / (h100.roofline_tok_s * 3600) * 1e6)
    assert place(cfg, "bf16", GPUS["T4"], PlanRequest(context=8192, concurrency=10_000)).gpus_needed is None


@pytest.mark.integration
def test_kv_bytes_equal_what_the_runtime_allocates():
    from llmopt.loader import load
    from llmopt.runtime.model_runner import kv_bytes_per_block

    model = load("default").model
    cfg = resolve("default").config
    for dtype, size in ((torch.bfloat16, 2), (torch.float32, 4)):
        assert kv_bytes_per_token(cfg, size) * 16 == kv_bytes_per_block(model, 16, dtype)


def _safetensors_data_bytes(path) -> int:
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    return len(raw) - 8 - header_len


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_int4_bytes_equal_the_quantizers_checkpoint(tiny_models, tmp_path, method):
    calib = tmp_path / "calib.txt"
    calib.write_text("Rivers run to the sea, and the sea does not fill. " * 40)
    out = tmp_path / "q"
    fmt = "gptq" if method == "gptq" else "awq"
    quantize(QuantizeRequest(model=str(tiny_models["llama"]), output=out, method=method, format=fmt, group_size=64,
                             calib=str(calib), num_samples=4, seq_len=32, seed=0))
    plan_format = WeightFormat(f"{fmt}-int4-g64", int4_bits(64), 16)  # the tiny model's widths take g64
    assert _safetensors_data_bytes(out / "model.safetensors") == weight_bytes(resolve(str(tiny_models["llama"])).config,
                                                                              plan_format)


@pytest.mark.parametrize("gguf_type", ["Q8_0", "Q4_0"])
def test_gguf_bytes_equal_the_exporters_file(tiny_models, tmp_path, gguf_type):
    import gguf

    out = tmp_path / f"tiny-{gguf_type}.gguf"
    code, err, _ = run_cli("quantize", str(tiny_models["llama"]), "-o", str(out), "--method", "gguf",
                           "--gguf-type", gguf_type)
    assert code == 0, err
    stored = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(out)).tensors)
    assert stored == weight_bytes(resolve(str(tiny_models["llama"])).config, FORMATS[f"gguf-{gguf_type}"])


def test_cli_plan(tmp_path):
    code, err, out = run_cli("plan", "llama-3-70b", "--context", "4096", "--concurrency", "4", "--gpu", "A100-80GB",
                             "--requests-per-hour", "50", "--json")
    assert code == 0, err
    result = json.loads(out)
    by_format = {p["format"]: p for p in result["formats"]}
    assert by_format["bf16"]["gpus_needed"] == 2 and by_format["awq-int4-g128"]["gpus_needed"] == 1
    assert result["recommendations"][0]["advice"] == "quantize to AWQ int4"
    assert any(r["advice"].startswith("serverless") for r in result["recommendations"])
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"A100-80GB": 1.0, "MI300X": {"memory_gib": 192, "bandwidth_gb_s": 5300,
                                                                "usd_per_hour": 3.0}}))
    code, err, out = run_cli("plan", "llama-3-8b", "--prices", str(prices), "--gpu", "MI300X", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert {p["gpu"]: p["usd_per_hour"] for p in result["gpus"]}["A100-80GB"] == 1.0
    code, err, out = run_cli("plan", "llama-3-8b")
    assert code == 0 and "awq-int4-g128" in out and "H100-SXM" in out


def test_cli_plan_bad_input(tmp_path):
    assert_usage_error(["plan", "llama-9"], "unknown model 'llama-9'")
    assert_usage_error(["plan", "llama-3-8b", "--gpu", "B300"], "unknown GPU 'B300'")
    assert_usage_error(["plan", "llama-3-8b", "--context", "100000"], "exceeds the model's 8192 positions")
    assert_usage_error(["plan", "llama-3-8b", "--kv-cache-dtype", "int2"], "--kv-cache-dtype")
    assert_usage_error(["plan", "llama-3-8b", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization")
    bad = tmp_path / "p.json"
    bad.write_text('{"Z1": 2}')
    assert_usage_error(["plan", "llama-3-8b", "--prices", str(bad)], "unknown GPU 'Z1'")
