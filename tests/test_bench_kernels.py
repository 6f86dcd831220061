"""`llmopt bench kernels`: the CPU run writes results.json / report.md with every expected row and
sane figures; bad input is one line, exit 2; on CUDA (marked gpu) the Triton rows run."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_usage_error, run_cli

from llmopt.bench.kernels_decode import DEFAULT_MODEL_HEADS
from llmopt.bench.kernels_int4 import DEFAULT_MODEL_SHAPES, LLAMA3_8B_SHAPES
from llmopt.bench.results import load_results
from llmopt.kernels.cpu_extension import cpu_ops

TINY = ["--rows", "1,3", "--batch", "2", "--context", "40", "--num-iters", "2", "--num-iters-warmup", "1"]


@pytest.fixture(scope="module")
def cpu_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("kernels")
    code, err, stdout = run_cli("bench", "kernels", "--device", "cpu", *TINY, "--output", str(out), "--json")
    assert code == 0, err
    return out, json.loads(stdout)


def test_cpu_rows_and_figures(cpu_results):
    out, printed = cpu_results
    document = load_results(out)
    assert document == json.loads(json.dumps(printed))  # --json prints what results.json holds
    assert document["kind"] == "kernels" and document["config"]["device"] == "cpu"
    assert document["config"]["copy_bandwidth_gb_s"] > 0 and document["config"]["gemm_tflops"] > 0
    runs = document["runs"]
    built = cpu_ops() is not None
    int4 = [r for r in runs if r["kernel"] == "int4_matmul"]
    # per shape and M: F.linear, skinny, int4; the vocabulary projection also int8 and bf16 (when built)
    expected = len(DEFAULT_MODEL_SHAPES) * 2 * 3 + 2 * (2 if built else 0)
    assert len(int4) == expected
    assert {r["problem"] for r in int4} == {f"{name} {k}->{n} M={m}" for name, (k, n) in DEFAULT_MODEL_SHAPES.items()
                                            for m in (1, 3)}
    decode = [r for r in runs if r["kernel"] == "paged_decode"]
    assert [r["backend"] for r in decode] == ["PyTorch gather + SDPA", "C++ kernel"]
    assert len({r["label"] for r in runs}) == len(runs)  # bench compare matches runs by label
    ran = [r for r in runs if not r["skipped"]]
    assert len(ran) == len(runs) if built else len(ran) >= len(DEFAULT_MODEL_SHAPES) * 2 + 1
    for run in ran:
        assert run["time_us"] > 0 and run["gb_s"] > 0 and run["speedup"] > 0, run
        assert run["baseline"] == (run["backend"] in ("F.linear fp32 (MKL)", "PyTorch gather + SDPA")), run
        if not run["baseline"]:
            assert run["rel_diff"] < 1e-4, run  # fp32 kernels against fp64 / their own references
    _, kv_heads, head_dim = DEFAULT_MODEL_HEADS
    assert decode[0]["bytes_read"] == 2 * 2 * 40 * kv_heads * head_dim * 4


def test_cpu_report(cpu_results):
    out, _ = cpu_results
    report = (out / "report.md").read_text()
    assert report.startswith("# llmopt bench kernels: cpu")
    assert "## int4 matmul" in report and "## paged decode attention" in report
    assert "| lm_head 576->49152 M=3 | F.linear fp32 (MKL) |" in report
    assert "copy bandwidth" in report


def test_one_kernel_only(tmp_path):
    code, err, stdout = run_cli("bench", "kernels", "--device", "cpu", "--kernels", "paged_decode", *TINY, "--json")
    assert code == 0, err
    assert {r["kernel"] for r in json.loads(stdout)["runs"]} == {"paged_decode"}


@pytest.mark.parametrize("args, fragment", [
    (["--rows", "0"], "--rows"),
    (["--rows", "1,x"], "--rows"),
    (["--batch", "-2"], "--batch"),
    (["--kernels", "int4_matmul,flash"], "'flash'"),
    (["--context", "0"], "--context"),
    (["--num-iters", "0"], "--num-iters"),
    (["--device", "tpu"], "--device"),
])
def test_bad_input(args, fragment, tmp_path):
    out = tmp_path / "never"
    # a later --device overrides the first
    assert_usage_error(["bench", "kernels", "--device", "cpu", *args, "--output", str(out)], fragment)
    assert not out.exists()  # checked before anything is written


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")
def test_cuda_without_cuda():
    assert_usage_error(["bench", "kernels", "--device", "cuda"], "CUDA is not available")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rows(tmp_path):
    code, err, stdout = run_cli("bench", "kernels", "--device", "cuda", "--rows", "1,16,128", "--context", "512",
                                "--num-iters", "5", "--output", str(tmp_path))
    assert code == 0, err
    runs = load_results(tmp_path)["runs"]
    triton = [r for r in runs if r["backend"].startswith("triton int4")]
    assert len(triton) == len(LLAMA3_8B_SHAPES) * 3 and not any(r["skipped"] for r in triton)
    assert {r["backend"] for r in triton} == {"triton int4 (gemv)", "triton int4 (splitk)", "triton int4 (gemm)"}
    for run in triton + [r for r in runs if r["kernel"] == "paged_decode"]:
        assert run["time_us"] > 0 and 0 < run["fraction_of_copy_bw"] < 3, run  # copy BW counts bytes read + written
        assert run["rel_diff"] < 3e-2, run  # fp16 / bf16 rounding against fp32
    assert any(r["backend"] == "gemlite int4" for r in runs)
