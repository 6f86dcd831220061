"""Every Triton kernel compiled by Triton's real compiler for sm_80, sm_89 and sm_90, on this CPU.

The interpreter the other Triton tests run in accepts programs the compiler may refuse (and never
lowers a bf16 or fp8 product); here `triton.compile` runs LLVM and ptxas for each target and the
test fails on any compile error. The variants come from the launchers' own dispatch functions
(`llmopt.kernels.triton_variants`, parameters from `llmopt.bench.kernel_variants`).

Wall time: a compile costs ~1.3 s of CPU (LLVM + ptxas), so the full matrix (~1,700 variants x
3 targets) takes hours on two cores. By default (LLMOPT_TRITON_COMPILE=smoke) a covering subset runs:
every dtype pair, exact-fp32 flag, bias / act-order / one-group / residual / one-pass flag, and split
vs no split of every kernel appears in one compiled variant per target (~40 variants, ~115 compiles:
about two minutes cold on two idle cores, seconds with Triton's cache warm). LLMOPT_TRITON_COMPILE=cover
adds every value of every constexpr (split counts, tile sizes, head dims, groups: ~55 variants,
~160 compiles, ~8 min here), =full compiles everything. fp8 pools are compiled for sm_89/sm_90 only:
Triton has no e4m3 below 8.9, and the runtime refuses an fp8 pool there (`FP8_MIN_ARCH`).
`scripts/triton_compile_report.py` prints the registers, spills and shared memory of the same variants.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from llmopt.bench.kernel_variants import decoder_shapes, shipped_params  # noqa: E402
from llmopt.kernels import triton_decoder_ops, triton_int4_kernels, triton_paged_decode  # noqa: E402
from llmopt.kernels.triton_variants import compile_tasks, compile_variants, enumerate_variants, select  # noqa: E402

ARCHS = [80, 89, 90]
SCOPE = os.environ.get("LLMOPT_TRITON_COMPILE", "smoke")
KERNELS_DIR = Path(triton_paged_decode.__file__).resolve().parent
# decode-path kernels (every decode step runs them): a spill there costs every token
DECODE_PATH = {"_write_kv_kernel", "_decode_split_kernel", "_merge_splits", "_gemv_kernel", "_gemm_kernel",
               "_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel"}
ACCEPTED_SPILLS: dict[str, str] = {}  # kernel -> why its spills are accepted (none so far)


def _have_ptxas() -> bool:
    try:
        from triton import knobs

        return Path(knobs.nvidia.ptxas.path).exists() and Path(knobs.nvidia.cuobjdump.path).exists()
    except Exception:  # noqa: BLE001  (a Triton without the NVIDIA backend)
        return False


needs_ptxas = pytest.mark.skipif(not _have_ptxas(), reason="this Triton ships no NVIDIA backend (ptxas, cuobjdump)")


def launched_kernels() -> set[str]:
    """Every kernel a launcher in kernels/triton_*.py launches (`name[grid](...)`)."""
    names = set()
    for path in KERNELS_DIR.glob("triton_*.py"):
        names |= set(re.findall(r"^\s+(_\w+)\[(?:\(|grid\])", path.read_text(), flags=re.MULTILINE))
    return names


def test_every_launched_kernel_is_enumerated():
    variants = enumerate_variants(shipped_params())
    assert launched_kernels() == {v.kernel for v in variants}
    assert len(launched_kernels()) == 13


def test_the_dispatch_choices_are_enumerated():
    """What the launchers pick at run time (split counts per batch bucket and GPU, split-K per shape)
    is among the enumerated constexprs."""
    variants = enumerate_variants(shipped_params())
    decode = {v.constexprs["NUM_SPLITS"] for v in variants if v.kernel == "_decode_split_kernel"}
    gemv = {v.constexprs["SPLIT_K"] for v in variants if v.kernel == "_gemv_kernel"}
    for sms in (108, 128, 132, 142):
        for batch in range(1, 257):
            assert triton_paged_decode.choose_num_splits(batch, 8, sms) in decode
        for tiles in (1, 16, 64, 448):
            for k_tiles in (1, 32, 112):
                assert triton_int4_kernels._split_k(torch.device("cpu"), tiles, k_tiles) in gemv
    # the decoder ops at every shipped model's widths, with the warps the norm's launcher asks for
    for hidden, intermediate, heads, kv_heads, head_dim in decoder_shapes():
        for dtype in ("float16", "bfloat16", "float32"):
            mine = [v for v in variants if v.tags == {"x": dtype}]
            for residual in (False, True):
                meta = triton_decoder_ops.norm_meta(hidden, residual)
                assert any(v.constexprs == meta and v.options == {"num_warps": triton_decoder_ops.norm_warps(
                    meta["BLOCK"])} for v in mine if v.kernel == "_rms_norm_kernel")
            rotary = triton_decoder_ops.rotary_meta(head_dim, heads, kv_heads)
            assert any(v.constexprs == rotary for v in mine if v.kernel == "_rotary_kernel")
            silu = {"BLOCK": triton_decoder_ops.silu_block(intermediate)}
            assert any(v.constexprs == silu for v in mine if v.kernel == "_silu_and_mul_kernel")
    assert {v.constexprs["ONE_PASS"] for v in variants if v.kernel == "_rms_norm_kernel"} == {True, False}
    llama8b = triton_paged_decode.decode_meta(4, 128, 16, triton_paged_decode.choose_num_splits(1, 8, 132),
                                              torch.bfloat16)
    assert any(v.constexprs == llama8b and v.tags == {"q": "bfloat16", "kv": "bfloat16"} for v in variants)


@needs_ptxas
def test_fp8_pools_do_not_compile_below_sm89():
    """Why the runtime refuses --kv-cache-dtype fp8 on an A100: Triton has no e4m3 there."""
    params = shipped_params()
    variants = enumerate_variants(params)
    fp8 = next(i for i, v in enumerate(variants) if v.kernel == "_write_kv_kernel" and "float8_e4m3fn" in v.tags.values())
    old, new = compile_variants(params, [(fp8, 80), (fp8, 89)])
    assert not old.ok and "fp8e4nv not supported" in old.error
    assert new.ok and new.registers > 0


@needs_ptxas
def test_every_kernel_compiles_for_sm80_sm89_sm90():
    params = shipped_params()
    variants = enumerate_variants(params)
    chosen = select(variants, SCOPE)
    tasks = compile_tasks(variants, chosen, ARCHS)
    results = compile_variants(params, tasks, jobs=os.cpu_count() or 2)
    failed = [f"sm_{r.arch} {r.label}: {r.error}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    assert {v.kernel for v in chosen} == launched_kernels()
    for arch in ARCHS:  # each kernel on every target the launchers may run it on (fp8 types from sm_89)
        assert {r.kernel for r in results if r.arch == arch} == {v.kernel for v in chosen if v.supported_on(arch)}
    assert {r.label for r in results if r.arch == 90} == {v.label() for v in chosen}
    assert any("float8" in r.label for r in results if r.arch == 89)
    assert not any("float8" in r.label for r in results if r.arch == 80)
    spills = [f"sm_{r.arch} {r.label}: {r.spills} spilled words" for r in results
              if r.spills and r.kernel in DECODE_PATH and r.kernel not in ACCEPTED_SPILLS]
    assert not spills, "\n".join(spills)


def test_the_triton_backend_refuses_fp8_pools_below_sm89(monkeypatch):
    from types import SimpleNamespace

    from llmopt.errors import LlmoptError
    from llmopt.model.backends.triton import TritonBackend

    pool = SimpleNamespace(dtype=torch.float8_e4m3fn, device=torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(LlmoptError, match="compute capability 8.9"):
        TritonBackend().paged_attention(pool, pool, torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert TritonBackend().paged_attention(pool, pool, torch.bfloat16).k_caches is pool
