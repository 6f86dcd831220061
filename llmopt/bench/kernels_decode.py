"""Paged decode attention micro-benchmarks for `llmopt bench kernels`.

One layer's decode attention: every sequence has `context` keys, its blocks (16 tokens, the
runtime's block size) drawn at random from a pool just large enough, so reads are scattered
as in a long-running server. The figure of merit is the K/V bytes the sequences attend to
over the time: decode attention is a stream over the cache.

CUDA: the Triton split-KV kernel (`llmopt.kernels.triton_paged_attention`) with Llama-3-8B's
heads (32 query, 8 KV, head dim 128) on a bf16 pool; max |diff| against the PyTorch path in
fp32 on the first sequences (the whole batch would need the gathered cache in fp32 again).
CPU: the C++ kernel (`cpu_paged_attention`) against the PyTorch path (gather the blocks,
then SDPA) it replaces, with the default model's heads (9 query, 3 KV, head dim 64), fp32.
"""

from __future__ import annotations

import os

import torch

from llmopt.bench.kernel_run import KernelRun, max_diff
from llmopt.bench.kernel_timing import CallTimer
from llmopt.kernels.paged_attention import decode_mask
from llmopt.kernels.paged_attention import paged_decode_attention as pytorch_decode

BLOCK_SIZE = 16
LLAMA3_8B_HEADS = (32, 8, 128)  # query heads, KV heads, head dim
DEFAULT_MODEL_HEADS = (9, 3, 64)
REFERENCE_SEQUENCES = 4  # sequences the CUDA kernel is checked on
KERNEL = "paged_decode"


def _problem(batch: int, context: int) -> str:
    return f"batch {batch} x {context} tokens"


def _inputs(batch: int, context: int, heads: tuple[int, int, int], dtype: torch.dtype, device: torch.device):
    """q [batch, heads, d] (fp32 on CPU, `dtype` on CUDA), K/V pools, block tables, context lengths."""
    q_heads, kv_heads, head_dim = heads
    gen = torch.Generator(device=device).manual_seed(0)
    width = -(-context // BLOCK_SIZE)
    num_blocks = batch * width
    k = torch.randn(num_blocks * BLOCK_SIZE, kv_heads, head_dim, generator=gen, device=device).to(dtype)
    v = torch.randn(num_blocks * BLOCK_SIZE, kv_heads, head_dim, generator=gen, device=device).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen, device=device).view(batch, width)
    lens = torch.full((batch,), context, device=device)
    q = torch.randn(batch, q_heads, head_dim, generator=gen, device=device).to(dtype)
    return q, k, v, tables, lens


def _kv_bytes(batch: int, context: int, heads: tuple[int, int, int], dtype: torch.dtype) -> int:
    _, kv_heads, head_dim = heads
    return 2 * batch * context * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def bench_decode_cuda(timer: CallTimer, batches: list[int], context: int, copy_gb_s: float) -> list[KernelRun]:
    device = timer.device
    runs: list[KernelRun] = []
    for batch in batches:
        common = dict(kernel=KERNEL, problem=_problem(batch, context), backend="triton bf16 pool",
                      reference="fp32 PyTorch path", copy_bandwidth_gb_s=copy_gb_s)
        if os.environ.get("TRITON_INTERPRET") == "1":  # interpreter timings say nothing about the kernel
            runs.append(KernelRun(skipped="TRITON_INTERPRET=1", **common))
            continue
        from llmopt.kernels.triton_paged_attention import DecodeWorkspace, paged_decode_attention

        q, k, v, tables, lens = _inputs(batch, context, LLAMA3_8B_HEADS, torch.bfloat16, device)
        tables, lens = tables.to(torch.int32), lens.to(torch.int32)
        scale = LLAMA3_8B_HEADS[2] ** -0.5

        workspace = DecodeWorkspace()  # as the runtime keeps one: no allocation inside the timed call

        def triton_call():
            return paged_decode_attention(q, k, v, tables, lens, BLOCK_SIZE, scale, workspace=workspace)

        n = min(batch, REFERENCE_SEQUENCES)
        ref = pytorch_decode(q[:n].float(), k, v, tables[:n].long(),
                             decode_mask(lens[:n], tables.shape[1] * BLOCK_SIZE, None))
        diff, rel = max_diff(triton_call()[:n], ref)
        runs.append(KernelRun(time_s=timer.median_call_s(triton_call), max_abs_diff=diff, rel_diff=rel,
                              bytes_read=_kv_bytes(batch, context, LLAMA3_8B_HEADS, torch.bfloat16), **common))
        del q, k, v, tables, lens, ref
        torch.cuda.empty_cache()
    return runs


def bench_decode_cpu(timer: CallTimer, batches: list[int], context: int, copy_gb_s: float) -> list[KernelRun]:
    from llmopt.kernels.cpu_paged_attention import decode_kernel

    kernel = decode_kernel()
    runs: list[KernelRun] = []
    for batch in batches:
        q, k, v, tables, lens = _inputs(batch, context, DEFAULT_MODEL_HEADS, torch.float32, timer.device)
        mask = decode_mask(lens, tables.shape[1] * BLOCK_SIZE, None)
        kv_bytes = _kv_bytes(batch, context, DEFAULT_MODEL_HEADS, torch.float32)
        common = dict(kernel=KERNEL, problem=_problem(batch, context), copy_bandwidth_gb_s=copy_gb_s)

        def pytorch_call():
            return pytorch_decode(q, k, v, tables, mask)

        ref = pytorch_call()
        base = KernelRun(backend="PyTorch gather + SDPA", time_s=timer.median_call_s(pytorch_call),
                         bytes_read=kv_bytes, speedup=1.0, baseline=True, reference="itself", **common)
        runs.append(base)
        if kernel is None:
            runs.append(KernelRun(backend="C++ kernel", skipped="C++ kernels not built here", **common))
            continue
        scale = DEFAULT_MODEL_HEADS[2] ** -0.5

        def cpp_call():
            return kernel(q, k, v, tables, lens, BLOCK_SIZE, scale, -1)

        diff, rel = max_diff(cpp_call(), ref)
        seconds = timer.median_call_s(cpp_call)
        runs.append(KernelRun(backend="C++ kernel", time_s=seconds, bytes_read=kv_bytes,
                              speedup=base.time_s / seconds, max_abs_diff=diff, rel_diff=rel,
                              reference="PyTorch path", **common))
    return runs
