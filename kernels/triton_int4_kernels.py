"""The Triton kernels behind `llmopt.kernels.triton_int4.int4_matmul`, and their launches.

Three kernels share one tile dequantizer (`_dequant_tile`, [BLOCK_K, BLOCK_N] in fp32):
- `_gemv_kernel`: one row of x per program along grid axis 2, x_row * w reduced over K
  in fp32 without tensor cores (a 1-row `tl.dot` would pad to 16 rows);
- `_gemm_kernel`: [BLOCK_M, BLOCK_N] output tiles by `tl.dot` (w cast to x's dtype, fp32
  accumulator), used with 16-row tiles and split-K for few rows and 64-row tiles otherwise;
- `_dequant_kernel`: writes the dense W^T [K, N] in x's dtype for torch's matmul.
With split-K each program takes every SPLIT_K-th K tile and writes an fp32 partial sum to
its own slice of a [SPLIT_K, M, N] buffer, then counts itself done on its output tile's
counter; the program that completes the count adds the tile's partials in a fixed order
(deterministic whichever finishes last), adds the bias, casts and stores the output, and
resets the counter: one launch per linear, no torch sum / add / cast after it (the CUDA
"threadfence reduction" pattern: a CTA barrier, then one acq_rel atomic per program, the
partials read back past L1). The counters (`_tile_counters`) are one zeroed int32 buffer
per device, shared by every launch: launches on one stream only.

Block sizes are first guesses, not tuned (no GPU was available when written): GEMV tiles
of 128 x 64 and 16/64-row dot tiles of 64 columns follow the sizes GemLite and vLLM's AWQ
Triton kernels start from. When the group width is a multiple of BLOCK_K (or there is one
group) a tile needs one row of scales and zero points; otherwise they are gathered per k.
Under TRITON_INTERPRET=1 these run on CPU tensors (the tests do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmopt.kernels.triton_int4 import PACK, PackedInt4

GEMV_BLOCK = (128, 64)  # (BLOCK_K, BLOCK_N)
SPLITK_BLOCK = (16, 64, 64)  # (BLOCK_M, BLOCK_N, BLOCK_K)
GEMM_BLOCK = (64, 64, 32)
DEQUANT_BLOCK = (64, 64)  # (BLOCK_K, BLOCK_N)
INTERPRETER_SMS = 4  # stand-in SM count on CPU: small, so the tests still see split-K > 1
MAX_SPLIT_K = 32  # more K slices than this only adds partial traffic
# Every SPLIT_K `_split_k` can return: the variants a GPU compiles.
SPLIT_K_CHOICES = tuple(2 ** i for i in range(MAX_SPLIT_K.bit_length()))


@triton.jit
def _dequant_tile(qw_ptr, s_ptr, z_ptr, k0, offs_k, k_mask, offs_n, n_mask, N, group_size,
                  ONE_GROUP: tl.constexpr):
    """w = (code - zero) * scale for input columns offs_k x output channels offs_n, fp32."""
    mask = k_mask[:, None] & n_mask[None, :]
    q = tl.load(qw_ptr + (offs_k[:, None] // 8) * N + offs_n[None, :], mask=mask, other=0)
    codes = (q >> ((offs_k[:, None] % 8) * 4)) & 0xF  # the sign bits an arithmetic shift drags in are masked off
    if ONE_GROUP:  # the whole tile is in group k0 // group_size: one row of scales and zeros
        g = k0 // group_size
        s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        z = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0).to(tl.float32)[None, :]
    else:
        g = offs_k // group_size
        s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g[:, None] * N + offs_n[None, :], mask=mask, other=0).to(tl.float32)
    return (codes.to(tl.float32) - z) * s


@triton.jit
def _input_columns(perm_ptr, offs_k, k_mask, HAS_PERM: tl.constexpr):
    """The columns of x that packed rows offs_k multiply: act-order weights read x through `perm`."""
    if HAS_PERM:
        return tl.load(perm_ptr + offs_k, mask=k_mask, other=0)
    return offs_k


@triton.jit
def _write_out(acc, bias, out_ptr, out_offs, part_ptr, part_offs, stride_ps, counter_ptr, tile, pid_k, mask,
               SPLIT_K: tl.constexpr):
    """acc (+ bias) in the output's dtype at out_offs. With split-K: acc is stored as partial
    pid_k, and the last of the tile's SPLIT_K programs sums the partials 0..SPLIT_K-1."""
    if SPLIT_K == 1:
        tl.store(out_ptr + out_offs, (acc + bias).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + pid_k * stride_ps + part_offs, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is stored before this program counts itself done
        done = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:  # the others are done, and their stores visible after the acquire
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for s in range(SPLIT_K):  # a fixed order: the same bits whichever program came last
                total += tl.load(part_ptr + s * stride_ps + part_offs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + out_offs, (total + bias).to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counter_ptr + tile, 0)  # ready for the next launch


@triton.jit
def _gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, bias_ptr, out_ptr, part_ptr, counter_ptr, N, K, group_size,
                 stride_xm, stride_xk, stride_om, stride_ps, stride_pm,
                 HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, ONE_GROUP: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for kt in range(pid_k, tl.cdiv(K, BLOCK_K), SPLIT_K):
        k0 = kt * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = _dequant_tile(qw_ptr, s_ptr, z_ptr, k0, offs_k, k_mask, offs_n, n_mask, N, group_size, ONE_GROUP)
        cols = _input_columns(perm_ptr, offs_k, k_mask, HAS_PERM)
        xk = tl.load(x_ptr + m * stride_xm + cols * stride_xk, mask=k_mask, other=0.0).to(tl.float32)
        acc += tl.sum(xk[:, None] * w, axis=0)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    _write_out(acc, bias, out_ptr, m * stride_om + offs_n, part_ptr, m * stride_pm + offs_n, stride_ps,
               counter_ptr, m * tl.num_programs(0) + pid_n, pid_k, n_mask, SPLIT_K)


@triton.jit
def _gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, bias_ptr, out_ptr, part_ptr, counter_ptr, M, N, K,
                 group_size, stride_xm, stride_xk, stride_om, stride_ps, stride_pm,
                 HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, ONE_GROUP: tl.constexpr,
                 INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // tiles_n  # consecutive programs share a row block of x and sweep N
    pid_n = pid % tiles_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(pid_k, tl.cdiv(K, BLOCK_K), SPLIT_K):
        k0 = kt * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = _dequant_tile(qw_ptr, s_ptr, z_ptr, k0, offs_k, k_mask, offs_n, n_mask, N, group_size, ONE_GROUP)
        cols = _input_columns(perm_ptr, offs_k, k_mask, HAS_PERM)
        xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :] * stride_xk,
                     mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(xt, w.to(xt.dtype), acc, input_precision=INPUT_PRECISION)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    _write_out(acc, bias, out_ptr, offs_m[:, None] * stride_om + offs_n[None, :],
               part_ptr, offs_m[:, None] * stride_pm + offs_n[None, :], stride_ps, counter_ptr, pid, pid_k,
               m_mask[:, None] & n_mask[None, :], SPLIT_K)


@triton.jit
def _dequant_kernel(qw_ptr, s_ptr, z_ptr, perm_ptr, out_ptr, N, K, group_size,
                    HAS_PERM: tl.constexpr, ONE_GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    k0 = tl.program_id(0) * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask = offs_k < K
    n_mask = offs_n < N
    w = _dequant_tile(qw_ptr, s_ptr, z_ptr, k0, offs_k, k_mask, offs_n, n_mask, N, group_size, ONE_GROUP)
    rows = _input_columns(perm_ptr, offs_k, k_mask, HAS_PERM)  # sorted column k is x's column perm[k]: W^T's row
    tl.store(out_ptr + rows[:, None] * N + offs_n[None, :], w.to(out_ptr.dtype.element_ty),
             mask=k_mask[:, None] & n_mask[None, :])


def _block_k(packed: PackedInt4, preferred: int) -> tuple[int, bool]:
    """(BLOCK_K, whether every tile lies in one group): the largest power of two <= preferred
    (and >= 16, `tl.dot`'s minimum) dividing the group width, else `preferred` with per-k scales."""
    if packed.groups == 1:
        return preferred, True
    block = preferred
    while block > 16 and packed.group_size % block:
        block //= 2
    if packed.group_size % block == 0:
        return block, True
    return preferred, False


def _split_k(device: torch.device, programs: int, k_tiles: int) -> int:
    """Power-of-two split of K (<= MAX_SPLIT_K) so that about two programs run per SM, each with >= 1 K tile."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else INTERPRETER_SMS
    split, target = 1, 2 * sms
    while programs * split * 2 <= target and split * 2 <= k_tiles and split < MAX_SPLIT_K:
        split *= 2
    return split


_COUNTERS: dict[torch.device, torch.Tensor] = {}
# counters a larger buffer replaced: kept alive, as CUDA graphs captured on them still use them
_RETIRED_COUNTERS: list[torch.Tensor] = []


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The split-K arrival counters, one int32 per output tile, zero between launches (each
    launch's last program resets its tiles); grown, zeroed, when a launch has more tiles (the old
    buffer is never freed: a captured graph may hold its address)."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < tiles:
        if counters is not None:
            _RETIRED_COUNTERS.append(counters)
        counters = _COUNTERS[device] = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
    return counters


def gemv_meta(packed: PackedInt4, has_bias: bool, split: int) -> dict:
    """The constexprs of `_gemv_kernel` for this weight (what `fused_matmul` passes)."""
    block_k, one_group = _block_k(packed, GEMV_BLOCK[0])
    return dict(HAS_PERM=packed.perm is not None, HAS_BIAS=has_bias, ONE_GROUP=one_group,
                BLOCK_K=block_k, BLOCK_N=GEMV_BLOCK[1], SPLIT_K=split)


def gemm_meta(packed: PackedInt4, has_bias: bool, split: int, path: str, x_dtype: torch.dtype) -> dict:
    """The constexprs of `_gemm_kernel` for the "splitk" or "gemm" path."""
    block_m, block_n, preferred_k = SPLITK_BLOCK if path == "splitk" else GEMM_BLOCK
    block_k, one_group = _block_k(packed, preferred_k)
    # fp32 x: no tf32 rounding; other dtypes ignore it
    return dict(HAS_PERM=packed.perm is not None, HAS_BIAS=has_bias, ONE_GROUP=one_group,
                INPUT_PRECISION="ieee" if x_dtype == torch.float32 else "tf32",
                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split)


def dequant_meta(packed: PackedInt4) -> dict:
    """The constexprs of `_dequant_kernel`."""
    block_k, one_group = _block_k(packed, DEQUANT_BLOCK[0])
    return dict(HAS_PERM=packed.perm is not None, ONE_GROUP=one_group, BLOCK_K=block_k, BLOCK_N=DEQUANT_BLOCK[1])


def fused_matmul(x: torch.Tensor, packed: PackedInt4, bias: torch.Tensor | None, path: str,
                 tune: dict | None = None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, N] in x's dtype by the "gemv", "splitk" or "gemm" kernel, one launch.

    `tune` (configuration sweeps, scripts/int4_sweep.py): BLOCK_N, BLOCK_K (a divisor of the group
    width, or any size for one group), SPLIT_K, num_warps, num_stages in place of the defaults."""
    m, k = x.shape
    n = packed.out_features
    if path not in ("gemv", "splitk", "gemm"):
        raise ValueError(f"unknown path {path!r}")
    tune = dict(tune or {})
    options = {key: tune.pop(key) for key in ("num_warps", "num_stages") if key in tune}
    forced_split = tune.pop("SPLIT_K", None)
    probe = gemv_meta(packed, False, 1) if path == "gemv" else gemm_meta(packed, False, 1, path, x.dtype)
    probe.update(tune)
    block_m = probe.get("BLOCK_M", 1)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, probe["BLOCK_N"])
    split = forced_split or (1 if path == "gemm" else _split_k(x.device, tiles, triton.cdiv(k, probe["BLOCK_K"])))
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out  # out: unused
    counters = _tile_counters(x.device, tiles) if split > 1 else packed.qweight  # a dummy pointer when unused
    bias_arg = bias.contiguous() if bias is not None else packed.scales  # a dummy pointer when unused
    perm = packed.perm if packed.perm is not None else packed.qweight
    args = (x, packed.qweight, packed.scales, packed.zeros, perm, bias_arg, out, part, counters)
    strides = (x.stride(0), x.stride(1), out.stride(0), part.stride(0) if split > 1 else 0,
               part.stride(1) if split > 1 else 0)
    if path == "gemv":
        _gemv_kernel[(triton.cdiv(n, probe["BLOCK_N"]), split, m)](
            *args, n, k, packed.group_size, *strides, **{**gemv_meta(packed, bias is not None, split), **tune},
            **options)
    else:
        _gemm_kernel[(tiles, split)](*args, m, n, k, packed.group_size, *strides,
                                     **{**gemm_meta(packed, bias is not None, split, path, x.dtype), **tune}, **options)
    return out


def dequantize_t(packed: PackedInt4, dtype: torch.dtype) -> torch.Tensor:
    """The dense W^T [K, N] in `dtype`, rows in x's column order (act-order undone here)."""
    k, n = packed.in_features, packed.out_features
    meta = dequant_meta(packed)
    out = torch.empty((k, n), dtype=dtype, device=packed.qweight.device)
    perm = packed.perm if packed.perm is not None else packed.qweight
    _dequant_kernel[(triton.cdiv(k, meta["BLOCK_K"]), triton.cdiv(n, meta["BLOCK_N"]))](
        packed.qweight, packed.scales, packed.zeros, perm, out, n, k, packed.group_size, **meta)
    return out


assert PACK == 8  # the kernels unpack with // 8 and % 8
