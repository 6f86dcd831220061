"""The Triton paged-attention kernels against the pure-PyTorch reference (`paged_attention.py`).

Without CUDA the kernels run on CPU tensors under the Triton interpreter (slow: shapes are
tiny); with CUDA the same tests run on the GPU, plus bf16 queries (the interpreter's bf16
tl.dot is wrong, so bf16 queries are GPU only).

Tolerances: fp32 queries 1e-5 (2e-5 on GPU, whose exp2 is approximate): kernel and
reference see the same values and differ in summation order only. fp16/bf16 queries are
compared with the reference run in fp32 on the same (already rounded) values: the
kernel rounds the softmax weights to the query dtype for the P @ V product and its output
to the query dtype, hence 2e-3 for fp16 and 1.6e-2 for bf16 (a few units in the last place).
Block tables are random permutations of the pool, padded with a written block.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported
pytest.importorskip("triton")

from llmopt.kernels import paged_attention as ref  # noqa: E402
from llmopt.kernels.triton_paged_attention import (  # noqa: E402
    FP8_DTYPE,
    FP8_MAX,
    choose_num_splits,
    paged_decode_attention,
    paged_prefill_attention,
    write_kv,
)
from llmopt.kernels import triton_paged_decode as decode_module  # noqa: E402
from llmopt.kernels.triton_paged_decode import (  # noqa: E402
    MAX_SPLITS,
    SPLIT_CHOICES,
    DecodeWorkspace,
    batch_bucket,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
gpu = pytest.mark.skipif(DEVICE.type != "cuda", reason="bf16 queries need CUDA (the interpreter's bf16 dot is wrong)")
KERNEL_FILES = ["triton_paged_attention.py", "triton_paged_decode.py", "triton_paged_prefill.py", "triton_write_kv.py"]


def _tol(dtype: torch.dtype) -> dict:
    if dtype == torch.float32:
        t = 2e-5 if DEVICE.type == "cuda" else 1e-5
    else:
        t = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    return {"atol": t, "rtol": t}


def _pool(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
          gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks * block_size, kv_heads, head_dim)
    return (torch.randn(shape, generator=gen).to(dtype).to(DEVICE),
            torch.randn(shape, generator=gen).to(dtype).to(DEVICE))


def _tables(totals: list[int], block_size: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """[num_seqs, width] block tables over a shuffled pool (rows padded with their first
    block, as the runtime does), and the pool's size in blocks (a few spare ones)."""
    need = [-(-n // block_size) for n in totals]
    num_blocks = sum(need) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width, rows, at = max(need), [], 0
    for n in need:
        used = order[at: at + n]
        at += n
        rows.append(used + [used[0]] * (width - n))
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE), num_blocks


def _slots(table: torch.Tensor, n: int, block_size: int) -> torch.Tensor:
    """The slots of a sequence's first n keys, in order (what the reference prefill takes)."""
    pos = torch.arange(n, device=DEVICE)
    return table.long()[pos // block_size] * block_size + pos % block_size


def _ref_decode(q, k_cache, v_cache, tables, lens, block_size, window):
    """The reference in fp32 (the ground truth for 16-bit queries too)."""
    mask = ref.decode_mask(lens, tables.shape[1] * block_size, window)
    return ref.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), tables, mask)


def _decode_case(lens, heads, kv_heads, head_dim, block_size, q_dtype, kv_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = _tables(lens, block_size, gen)
    k_cache, v_cache = _pool(num_blocks, block_size, kv_heads, head_dim, kv_dtype, gen)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(q_dtype).to(DEVICE)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32, device=DEVICE)


# lengths: a single key, mid-block ends, an exact block multiple, several blocks
DECODE_LENS = [1, 7, 32, 45, 90]


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window", [None, 20])
def test_decode_matches_reference_with_and_without_split_kv(group, block_size, window):
    kv_heads, head_dim = 2, 16
    q, k_cache, v_cache, tables, lens = _decode_case(DECODE_LENS, group * kv_heads, kv_heads, head_dim, block_size,
                                                     torch.float32, torch.float32, seed=group * block_size)
    expected = _ref_decode(q, k_cache, v_cache, tables, lens, block_size, window)
    for splits in (1, 3):
        got = paged_decode_attention(q, k_cache, v_cache, tables, lens, block_size, head_dim ** -0.5, window,
                                     num_splits=splits)
        assert got.shape == q.shape and got.dtype == q.dtype
        torch.testing.assert_close(got, expected, **_tol(torch.float32), msg=f"num_splits={splits}")


def test_decode_more_splits_than_keys():
    """Splits past a short sequence's end are empty: the merge must give them weight 0."""
    q, k_cache, v_cache, tables, lens = _decode_case([1, 5, 40], 4, 2, 16, 16, torch.float32, torch.float32, seed=3)
    expected = _ref_decode(q, k_cache, v_cache, tables, lens, 16, None)
    got = paged_decode_attention(q, k_cache, v_cache, tables, lens, 16, 16 ** -0.5, None, num_splits=8)
    torch.testing.assert_close(got, expected, **_tol(torch.float32))


@pytest.mark.parametrize("min_keys", [256, 8])
def test_decode_default_splits(monkeypatch, min_keys):
    """The split count the batch's bucket gets (32 here), each sequence using as many as its own length
    warrants: with 8 keys per split the 9-key sequence uses 1 split, the 70-key one 8, the rest stay empty."""
    monkeypatch.setattr(decode_module, "_num_sms", lambda device: 64)
    monkeypatch.setattr(decode_module, "MIN_KEYS_PER_SPLIT", min_keys)
    assert choose_num_splits(2, 2, 64) == 32
    q, k_cache, v_cache, tables, lens = _decode_case([9, 70], 6, 2, 32, 16, torch.float32, torch.float32, seed=4)
    expected = _ref_decode(q, k_cache, v_cache, tables, lens, 16, 30)
    got = paged_decode_attention(q, k_cache, v_cache, tables, lens, 16, 32 ** -0.5, 30)
    torch.testing.assert_close(got, expected, **_tol(torch.float32))


def test_decode_workspace_is_reused():
    """The runtime's workspace: the same buffer for every call that fits, grown once for a larger one,
    with stale partials of an earlier call never leaking into a later result."""
    workspace = DecodeWorkspace()
    small = _decode_case([5, 40], 4, 2, 16, 16, torch.float32, torch.float32, seed=8)
    large = _decode_case([33, 1, 64, 17], 4, 2, 16, 16, torch.float32, torch.float32, seed=9)
    buffers = []
    for case, splits in ((small, 4), (small, 2), (large, 4), (small, 4)):
        q, k_cache, v_cache, tables, lens = case
        got = paged_decode_attention(q, k_cache, v_cache, tables, lens, 16, 16 ** -0.5, None, num_splits=splits,
                                     workspace=workspace)
        torch.testing.assert_close(got, _ref_decode(q, k_cache, v_cache, tables, lens, 16, None),
                                   **_tol(torch.float32))
        buffers.append(workspace.buffer.data_ptr())
    assert buffers[0] == buffers[1] and buffers[2] == buffers[3]  # reused while it fits
    assert workspace.buffer.numel() == 4 * 4 * 4 * 17  # grown for the large call: batch*heads*splits*(16+1)


DTYPE_CASES = [
    (torch.float16, torch.float16),  # a 16-bit model
    (torch.float32, torch.bfloat16),  # fp32 model, narrower pool (--kv-cache-dtype)
    (torch.float32, torch.float16),
    pytest.param(torch.bfloat16, torch.bfloat16, marks=gpu),
]


@pytest.mark.parametrize("q_dtype,kv_dtype", DTYPE_CASES)
def test_decode_dtypes(q_dtype, kv_dtype):
    q, k_cache, v_cache, tables, lens = _decode_case(DECODE_LENS, 8, 2, 32, 16, q_dtype, kv_dtype, seed=5)
    expected = _ref_decode(q, k_cache, v_cache, tables, lens, 16, None)
    for splits in (1, 2):
        got = paged_decode_attention(q, k_cache, v_cache, tables, lens, 16, 32 ** -0.5, None, num_splits=splits)
        assert got.dtype == q_dtype
        torch.testing.assert_close(got.float(), expected, **_tol(q_dtype))


@pytest.mark.parametrize("window", [None, 6])
def test_decode_reads_only_the_keys_it_attends(window):
    """Poison every slot outside each sequence's attended keys (unowned blocks, the unused
    tail of its last block, keys before the window): a stray read would show up as NaN."""
    block_size, lens = 16, [3, 20, 40]
    q, k_cache, v_cache, tables, ctx = _decode_case(lens, 4, 2, 16, block_size, torch.float32, torch.float32, seed=6)
    expected = _ref_decode(q, k_cache, v_cache, tables, ctx, block_size, window)
    keep = torch.zeros(k_cache.shape[0], dtype=torch.bool, device=DEVICE)
    for row, n in zip(tables, lens):
        first = 0 if window is None else max(0, n - window)
        keep[_slots(row, n, block_size)[first:]] = True
    k_cache[~keep] = float("nan")
    v_cache[~keep] = float("nan")
    for splits in (1, 4):
        got = paged_decode_attention(q, k_cache, v_cache, tables, ctx, block_size, 16 ** -0.5, window,
                                     num_splits=splits)
        torch.testing.assert_close(got, expected, **_tol(torch.float32))


def test_split_count_depends_on_the_batch_bucket_only():
    """NUM_SPLITS is a constexpr: it comes from the batch's bucket and the GPU, never from context
    lengths, so growing contexts compile nothing new; it is always one of SPLIT_CHOICES."""
    sms = 132
    assert choose_num_splits(batch=256, kv_heads=8, num_sms=sms) == 1  # grid already full
    assert choose_num_splits(batch=1, kv_heads=8, num_sms=sms) == MAX_SPLITS == 32  # 33 wanted, capped
    assert choose_num_splits(batch=4, kv_heads=8, num_sms=sms) == 8  # ceil(264 / 32) = 9, down to a power of two
    assert choose_num_splits(batch=3, kv_heads=8, num_sms=sms) == 8  # bucket 4
    assert choose_num_splits(batch=1, kv_heads=1, num_sms=sms) == MAX_SPLITS
    for sms in (1, 46, 108, 132, 142):
        for kv_heads in (1, 2, 4, 8, 16):
            for batch in range(1, 300):
                splits = choose_num_splits(batch, kv_heads, sms)
                assert splits in SPLIT_CHOICES
                assert splits == choose_num_splits(batch_bucket(batch), kv_heads, sms)


def _prefill_case(contexts, chunks, heads, kv_heads, head_dim, block_size, q_dtype, kv_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = _tables([c + n for c, n in zip(contexts, chunks)], block_size, gen)
    k_cache, v_cache = _pool(num_blocks, block_size, kv_heads, head_dim, kv_dtype, gen)
    q = torch.randn(sum(chunks), heads, head_dim, generator=gen).to(q_dtype).to(DEVICE)
    cu = torch.tensor([0] + torch.tensor(chunks).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, tables, cu, torch.tensor(contexts, dtype=torch.int32, device=DEVICE)


def _ref_prefill(q, k_cache, v_cache, tables, cu, contexts, block_size, window):
    outs = []
    for n, ctx in enumerate(contexts.tolist()):
        chunk = q[cu[n]: cu[n + 1]].float()
        slots = _slots(tables[n], ctx + chunk.shape[0], block_size)
        outs.append(ref.paged_prefill_attention(chunk, k_cache.float(), v_cache.float(), slots, ctx, window))
    return torch.cat(outs)


# per sequence: tokens cached before the chunk, chunk length. A fresh prompt, chunks over
# a cached prefix ending mid-block, a one-token chunk, a chunk longer than one query tile.
PREFILL_CONTEXTS = [0, 20, 37, 16]
PREFILL_CHUNKS = [30, 9, 1, 70]


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window", [None, 12])
def test_prefill_matches_reference(group, block_size, window):
    kv_heads, head_dim = 2, 16
    q, k_cache, v_cache, tables, cu, ctx = _prefill_case(PREFILL_CONTEXTS, PREFILL_CHUNKS, group * kv_heads, kv_heads,
                                                         head_dim, block_size, torch.float32, torch.float32,
                                                         seed=group + block_size)
    expected = _ref_prefill(q, k_cache, v_cache, tables, cu, ctx, block_size, window)
    got = paged_prefill_attention(q, k_cache, v_cache, tables, cu, ctx, block_size, head_dim ** -0.5, window)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got, expected, **_tol(torch.float32))


@pytest.mark.parametrize("q_dtype,kv_dtype", DTYPE_CASES)
def test_prefill_dtypes(q_dtype, kv_dtype):
    q, k_cache, v_cache, tables, cu, ctx = _prefill_case([0, 21], [25, 6], 6, 2, 32, 16, q_dtype, kv_dtype, seed=7)
    expected = _ref_prefill(q, k_cache, v_cache, tables, cu, ctx, 16, None)
    got = paged_prefill_attention(q, k_cache, v_cache, tables, cu, ctx, 16, 32 ** -0.5, None, max_query_len=25)
    assert got.dtype == q_dtype
    torch.testing.assert_close(got.float(), expected, **_tol(q_dtype))


@pytest.mark.parametrize("window", [None, 10])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8_DTYPE])
def test_chunked_prefill_then_decode_equals_one_pass(window, kv_dtype):
    """A prompt written and attended chunk by chunk (write_kv, then prefill over the cached
    prefix), then decoded one token, gives what one whole-prompt pass over the same
    (rounded, for fp8 scaled) K/V gives."""
    block_size, kv_heads, heads, head_dim = 16, 1, 4, 16
    gen = torch.Generator().manual_seed(8)
    total = 41
    tables, num_blocks = _tables([total], block_size, gen)
    k_cache = torch.zeros(num_blocks * block_size, kv_heads, head_dim, dtype=kv_dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    q = torch.randn(total, heads, head_dim, generator=gen).to(DEVICE)
    k = torch.randn(total, kv_heads, head_dim, generator=gen).to(DEVICE)
    v = torch.randn(total, kv_heads, head_dim, generator=gen).to(DEVICE)
    slots = _slots(tables[0], total, block_size)
    scale = head_dim ** -0.5
    scales = {"k_scale": 0.02, "v_scale": 0.05} if kv_dtype == FP8_DTYPE else {}

    outs, done = [], 0
    for n in (13, 19, 8):  # the last token (position 40) is the decode
        write_kv(k_cache, v_cache, slots[done: done + n], k[done: done + n], v[done: done + n], **scales)
        cu = torch.tensor([0, n], dtype=torch.int32, device=DEVICE)
        ctx = torch.tensor([done], dtype=torch.int32, device=DEVICE)
        outs.append(paged_prefill_attention(q[done: done + n], k_cache, v_cache, tables, cu, ctx, block_size, scale,
                                            window, **scales))
        done += n
    write_kv(k_cache, v_cache, slots[done:], k[done:], v[done:], **scales)
    lens = torch.tensor([total], dtype=torch.int32, device=DEVICE)
    outs.append(paged_decode_attention(q[done:], k_cache, v_cache, tables, lens, block_size, scale, window,
                                       num_splits=2, **scales))

    if kv_dtype == FP8_DTYPE:
        k_seen, v_seen = _fp8_dequant(_fp8_quant(k, 0.02), 0.02), _fp8_dequant(_fp8_quant(v, 0.05), 0.05)
    else:
        k_seen, v_seen = k.to(kv_dtype).float(), v.to(kv_dtype).float()
    mask = ref.prefill_mask(total, 0, window, DEVICE)
    expected = ref.attend(q, k_seen, v_seen, mask)
    torch.testing.assert_close(torch.cat(outs), expected, **_tol(torch.float32))


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.float16])
def test_write_kv_matches_reference_exactly(kv_dtype, src_dtype):
    gen = torch.Generator().manual_seed(9)
    shape = (64, 3, 24)  # head_dim 24: not a power of two
    k_cache = torch.randn(shape, generator=gen).to(kv_dtype).to(DEVICE)
    v_cache = torch.randn(shape, generator=gen).to(kv_dtype).to(DEVICE)
    k = (torch.randn(5, 3, 24, generator=gen) * 100).to(src_dtype).to(DEVICE)
    v = torch.randn(5, 3, 24, generator=gen).to(src_dtype).to(DEVICE)
    k[0, 0, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    slots = torch.tensor([7, 63, 0, 31, 12], device=DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref.write_kv(k_ref, v_ref, slots, k, v)
    write_kv(k_cache, v_cache, slots, k, v)
    # exact values (any rounding difference shows), NaN where the reference has NaN (its
    # payload bits differ between torch's own CPU paths, so bits are not compared)
    torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0, equal_nan=True)


def test_write_kv_skips_negative_slots():
    k_cache = torch.zeros(32, 2, 16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k = torch.ones(3, 2, 16, device=DEVICE)
    write_kv(k_cache, v_cache, torch.tensor([4, -1, 9], device=DEVICE), k, 2 * k)
    assert k_cache.sum() == 2 * 32 and v_cache.sum() == 2 * 2 * 32
    assert (k_cache[[4, 9]] == 1).all() and (v_cache[[4, 9]] == 2).all()


def _fp8_quant(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an fp8 pool holds for x: x / scale, saturated, as e4m3 (torch's rounding)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _fp8_dequant(stored: torch.Tensor, scale: float) -> torch.Tensor:
    return stored.float() * scale


def test_write_kv_fp8_matches_torch_quantisation_exactly():
    gen = torch.Generator().manual_seed(10)
    k_scale, v_scale = 0.03, 2.0
    k = torch.randn(6, 2, 32, generator=gen) * 3
    v = torch.randn(6, 2, 32, generator=gen) * 300
    # edge cases: rounding up across a power of two, ties, e4m3 subnormals and their
    # rounding, saturation past 448, infinities, NaN
    edges = torch.tensor([31.9, -31.9, 15.5, 17.0, 0.015, -0.0009, 0.00098, 1e-9, 500.0, -1e6,
                          float("inf"), float("-inf"), float("nan"), 0.0, 448.0, 464.0])
    k[0, 0, :16] = edges * k_scale
    v[0, 1, :16] = edges * v_scale
    k, v = k.to(DEVICE), v.to(DEVICE)
    k_cache = torch.zeros(16, 2, 32, dtype=FP8_DTYPE, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, 0, 15, 8, 9, 4], device=DEVICE)
    write_kv(k_cache, v_cache, slots, k, v, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(k_cache[slots].float(), _fp8_quant(k, k_scale).float(), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache[slots].float(), _fp8_quant(v, v_scale).float(), rtol=0, atol=0, equal_nan=True)


FP8_SCALES = {"k_scale": 0.02, "v_scale": 0.5}


def _fp8_pools(k_cache: torch.Tensor, v_cache: torch.Tensor):
    """fp8 pools holding k/v at FP8_SCALES, and the fp32 pools of the values they stand for."""
    k8, v8 = _fp8_quant(k_cache, FP8_SCALES["k_scale"]), _fp8_quant(v_cache, FP8_SCALES["v_scale"])
    return k8, v8, _fp8_dequant(k8, FP8_SCALES["k_scale"]), _fp8_dequant(v8, FP8_SCALES["v_scale"])


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16])
def test_decode_and_prefill_over_fp8_pool(q_dtype):
    """An e4m3 pool with per-layer scales reads as stored * scale: the same result as the
    reference over an fp32 pool of those values (so the fp32 / fp16 tolerances hold)."""
    q, k_cache, v_cache, tables, lens = _decode_case(DECODE_LENS, 8, 2, 16, 16, q_dtype, torch.float32, seed=11)
    k8, v8, k_deq, v_deq = _fp8_pools(k_cache * 0.05, v_cache)  # keys ~ 2.5 stored units: several binades
    expected = _ref_decode(q, k_deq, v_deq, tables, lens, 16, 20)
    for splits in (1, 3):
        got = paged_decode_attention(q, k8, v8, tables, lens, 16, 16 ** -0.5, 20, num_splits=splits, **FP8_SCALES)
        torch.testing.assert_close(got.float(), expected, **_tol(q_dtype))

    q, k_cache, v_cache, tables, cu, ctx = _prefill_case([0, 21], [25, 6], 6, 2, 16, 16, q_dtype, torch.float32,
                                                         seed=12)
    k8, v8, k_deq, v_deq = _fp8_pools(k_cache * 0.05, v_cache)
    expected = _ref_prefill(q, k_deq, v_deq, tables, cu, ctx, 16, None)
    got = paged_prefill_attention(q, k8, v8, tables, cu, ctx, 16, 16 ** -0.5, None, **FP8_SCALES)
    torch.testing.assert_close(got.float(), expected, **_tol(q_dtype))


def test_kernel_files_import_nothing_from_llmopt_outside_kernels():
    kernels_dir = Path(ref.__file__).parent
    for name in KERNEL_FILES:
        tree = ast.parse((kernels_dir / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{name}: relative import"
                modules = [node.module or ""]
            else:
                continue
            for module in modules:
                assert not module.startswith("llmopt") or module.startswith("llmopt.kernels"), f"{name} imports {module}"
                assert module.split(".")[0] in {"__future__", "math", "torch", "triton", "llmopt"}, f"{name}: {module}"
