"""int4 weight x fp16 / bf16 / fp32 activation matmul in Triton, for AWQ and GPTQ weights.

`y = x @ W^T (+ bias)` where W [N, K] is stored as 4-bit codes with a scale and an integer
zero point per group of input columns: w = (code - zero) * scale. Accumulation is fp32; the
output has x's dtype.

`pack_int4` takes what llmopt's core unpacks from AutoAWQ GEMM and GPTQ v1 checkpoints
(codes [N, K] 0..15, scales [N, groups] float32, zeros [N, groups] int, g_idx [K]) and repacks
it once, at load, into `PackedInt4` (`pack_int4_rows`: a slab of output channels at a time, on the
target device); `int4_matmul` picks one of four paths by row count:

- `gemv`: M <= `PathThresholds.gemv_max_rows`. No tensor cores: each program dequantizes
  a [BLOCK_K, BLOCK_N] tile and reduces x_row * w over K in fp32, K split across programs.
- `splitk`: M <= `splitk_max_rows`. `tl.dot` with a 16-row tile; K split across programs
  so a skinny problem still fills the GPU (decode is memory bound: the weight is read once).
- `gemm`: larger M. `tl.dot` with 64-row tiles, no split.
- `dequant`: M >= `dequant_min_rows`. One Triton pass writes the dense W^T in x's dtype and
  torch's matmul (cuBLAS) does the rest: there the problem is compute bound and cuBLAS wins.

Split-K programs write fp32 partial sums; the last program of each output tile adds them up
in a fixed order, with the bias and the cast, inside the same launch, so results are
deterministic (an atomic counts arrivals, never sums values). The `@triton.jit` kernels and their launches live in
`triton_int4_kernels.py`, imported on the first call, so packing and the reference load
without Triton. Neither module imports anything from llmopt outside `llmopt.kernels`.
`reference_int4_matmul` is the same product in plain PyTorch (fp32), for tests.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

PACK = 8  # codes per int32
BITS = 4


@dataclass(frozen=True)
class PathThresholds:
    """Row counts where `int4_matmul` switches path (tests override them to reach every path).

    They follow public kernels (`llmopt bench kernels --device cuda` measures the paths on a GPU):
    - GemLite (`gemlite/core.py: get_matmul_type`) uses its GEMV for batch 1, split-K GEMM up
      to 64 rows, and plain GEMM above; we switch to the unsplit GEMM earlier (16 rows) since
      our split-K tile is 16 rows tall.
    - vLLM's AWQ layer (`awq.py`, `FP16_MATMUL_HEURISTIC_CONDITION`) and AutoAWQ's
      `WQLinear_GEMM` dequantize and call the fp16 matmul from 256 tokens (AutoAWQ: 1024).
    """

    gemv_max_rows: int = 1
    splitk_max_rows: int = 16
    dequant_min_rows: int = 256


DEFAULT_THRESHOLDS = PathThresholds()


@dataclass
class PackedInt4:
    """A 4-bit weight in the kernels' layout.

    Layout, and why:
    - `qweight` int32 [ceil(K / 8), N]: 8 consecutive input columns (k = 8i .. 8i+7, code of
      column 8i + j in bits 4j..4j+3) of one output channel per int32. Packing along K makes
      a loaded [BLOCK_K / 8, BLOCK_N] tile contiguous along N (coalesced), and unpacking it
      gives the [BLOCK_K, BLOCK_N] operand `tl.dot` wants as is, with no transposition and
      no AWQ nibble reordering (AWQ's interleaved order is undone here, once).
    - `scales` fp16 [groups, N], `zeros` uint8 [groups, N]: one row per group, contiguous
      along N like the codes, so a tile inside one group loads a single [1, BLOCK_N] row.
      fp16 is what AWQ / GPTQ checkpoints store (llmopt's quantizer rounds scales to fp16),
      so it is lossless for them; integer zero points 0..15 fit a byte exactly, half of fp16.
    - Act-order (GPTQ desc_act, a non-sequential g_idx): the input columns are sorted by
      group once here, so groups are contiguous runs again; `perm` [K] (int32) maps sorted
      column k to x's column perm[k], and the kernels read x through it (a gather of the
      small activation; no extra launch and no permuted copy of x per call).
    - Groups of uneven size after sorting (rare; not produced by AWQ or GPTQ) are re-expressed
      on the widest power-of-two block (<= 128 columns) that never straddles two groups.
    """

    qweight: torch.Tensor  # int32 [ceil(K / 8), N]
    scales: torch.Tensor  # fp16 [groups, N]
    zeros: torch.Tensor  # uint8 [groups, N]
    perm: torch.Tensor | None  # int32 [K]: sorted column k multiplies x[:, perm[k]]; None = identity
    in_features: int  # K
    out_features: int  # N
    group_size: int  # input columns per group (K for one group per row)

    @property
    def groups(self) -> int:
        return self.scales.shape[0]

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.qweight, self.scales, self.zeros, self.perm) if t is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def to(self, device: torch.device | str) -> PackedInt4:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return PackedInt4(move(self.qweight), move(self.scales), move(self.zeros), move(self.perm),
                          self.in_features, self.out_features, self.group_size)


def _even_groups(g: torch.Tensor) -> int | None:
    """The group width if sorted group ids `g` are 0, 1, 2, ... each repeated equally often."""
    ids, counts = torch.unique_consecutive(g, return_counts=True)
    if torch.equal(ids, torch.arange(len(ids), device=g.device)) and bool((counts == counts[0]).all()):
        return int(counts[0])
    return None


# codes per slab of output channels packed at a time: a few MB of temporaries, never a whole projection's
SLAB_CODES = 1 << 22


def pack_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor,
              scale_dtype: torch.dtype = torch.float16) -> PackedInt4:
    """Codes [N, K] (0..15), scales [N, groups], zero points [N, groups], the group of each
    input column g_idx [K] -> `PackedInt4` on the codes' device. Raises ValueError for a
    layout the kernels cannot take (codes out of range, uneven groups on no common block)."""
    if codes.dim() != 2 or codes.numel() == 0:
        raise ValueError(f"codes must be a non-empty [N, K] matrix, got shape {tuple(codes.shape)}")
    return pack_int4_rows(lambda start, stop: codes[start:stop], tuple(codes.shape), scales, zeros, g_idx,
                          codes.device, scale_dtype)


def pack_int4_rows(code_rows: Callable[[int, int], torch.Tensor], shape: tuple[int, int], scales: torch.Tensor,
                   zeros: torch.Tensor, g_idx: torch.Tensor, device: torch.device | str,
                   scale_dtype: torch.dtype = torch.float16) -> PackedInt4:
    """`pack_int4` of the [N, K] codes `code_rows(start, stop)` gives a slab of output channels at a
    time (rows start..stop-1), packed on `device` slab by slab (`SLAB_CODES` codes): the same
    layout, without the whole projection's codes (or a wider copy of them) at any moment."""
    n, k = shape
    if n * k == 0:
        raise ValueError(f"codes must be a non-empty [N, K] matrix, got shape {tuple(shape)}")
    if scales.shape != zeros.shape or scales.shape[0] != n or g_idx.shape != (k,):
        raise ValueError(f"shapes disagree: codes {tuple(shape)}, scales {tuple(scales.shape)}, "
                         f"zeros {tuple(zeros.shape)}, g_idx {tuple(g_idx.shape)}")
    device = torch.device(device)
    g = g_idx.long().to(device)
    perm = None
    if not torch.equal(g, torch.sort(g, stable=True).values):  # act-order: sort the columns by group once
        perm = torch.argsort(g, stable=True)
        g = g[perm]
    width = _even_groups(g)
    if width is not None:
        scales, zeros = scales[:, :len(g) // width], zeros[:, :len(g) // width]
    else:  # uneven groups: one scale row per block of `width` columns that stays inside a group
        for width in (128, 64, 32, 16, 8):
            if k % width == 0 and bool((g.reshape(-1, width) == g.reshape(-1, width)[:, :1]).all()):
                break
        else:
            raise ValueError("uneven groups that split every block of 8 input columns")
        block_group = g.reshape(-1, width)[:, 0].to(scales.device)
        scales, zeros = scales[:, block_group], zeros[:, block_group]
    k8 = -(-k // PACK) * PACK
    qweight = torch.empty(k8 // PACK, n, dtype=torch.int32, device=device)
    step = max(1, SLAB_CODES // k8)
    for start in range(0, n, step):
        stop = min(start + step, n)
        codes = code_rows(start, stop).to(device)
        if int(codes.min()) < 0 or int(codes.max()) > 15:
            raise ValueError("codes must lie in 0..15")
        if perm is not None:
            codes = codes[:, perm]
        padded = torch.zeros(stop - start, k8, dtype=torch.uint8, device=device)  # code 0 past K: finite, times x = 0
        padded[:, :k] = codes
        nibbles = padded.view(stop - start, k8 // PACK, PACK)
        words = nibbles[:, :, 0].to(torch.int32)
        for j in range(1, PACK):  # disjoint nibbles ORed in; int32 wraps the top nibble into the sign bit
            words |= nibbles[:, :, j].to(torch.int32) << (BITS * j)
        qweight[:, start:stop] = words.t()
    return PackedInt4(
        qweight=qweight,
        scales=scales.t().to(device=device, dtype=scale_dtype).contiguous(),
        zeros=zeros.t().to(device=device, dtype=torch.uint8).contiguous(),
        perm=None if perm is None else perm.to(torch.int32).contiguous(),
        in_features=k, out_features=n, group_size=width,
    )


def unpack_codes(packed: PackedInt4) -> torch.Tensor:
    """The int32 codes [N, K] in sorted column order (undoes the nibble packing)."""
    shifts = (torch.arange(PACK, device=packed.qweight.device, dtype=torch.int32) * BITS).view(1, PACK, 1)
    nibbles = (packed.qweight.unsqueeze(1) >> shifts) & 0xF
    return nibbles.reshape(-1, packed.out_features)[:packed.in_features].t()


def dequantize(packed: PackedInt4) -> torch.Tensor:
    """The fp32 weight [N, K] in x's column order, in plain PyTorch."""
    g = torch.arange(packed.in_features, device=packed.qweight.device) // packed.group_size
    scales, zeros = packed.scales.float().t()[:, g], packed.zeros.float().t()[:, g]
    w_sorted = (unpack_codes(packed).float() - zeros) * scales
    if packed.perm is None:
        return w_sorted
    w = torch.empty_like(w_sorted)
    w[:, packed.perm.long()] = w_sorted
    return w


def reference_int4_matmul(x: torch.Tensor, packed: PackedInt4, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T (+ bias) computed in fp32 from the dequantized weight, returned in x's dtype."""
    y = x.float() @ dequantize(packed).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def choose_path(rows: int, thresholds: PathThresholds = DEFAULT_THRESHOLDS) -> str:
    """"gemv", "splitk", "gemm" or "dequant" for a product with `rows` rows of x."""
    if rows >= thresholds.dequant_min_rows:
        return "dequant"
    if rows <= thresholds.gemv_max_rows:
        return "gemv"
    if rows <= thresholds.splitk_max_rows:
        return "splitk"
    return "gemm"


def int4_matmul(x: torch.Tensor, packed: PackedInt4, bias: torch.Tensor | None = None,
                thresholds: PathThresholds = DEFAULT_THRESHOLDS) -> torch.Tensor:
    """x [..., K] (fp16 / bf16 / fp32) @ W^T (+ bias [N]) -> [..., N] in x's dtype, with the
    path `choose_path` picks for the row count. x, the packed weight and bias share a device
    (CUDA, or CPU under TRITON_INTERPRET=1)."""
    from llmopt.kernels import triton_int4_kernels as launch  # Triton is imported here, not at module load

    k, n = packed.in_features, packed.out_features
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {k}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported activation dtype {x.dtype}")
    flat = x.reshape(-1, k)
    rows = flat.shape[0]
    if rows == 0:
        out = x.new_empty(0, n)
    else:
        path = choose_path(rows, thresholds)
        if path == "dequant":
            w_t = launch.dequantize_t(packed, x.dtype)
            out = flat @ w_t if bias is None else torch.addmm(bias.to(x.dtype), flat, w_t)
        else:
            out = launch.fused_matmul(flat, packed, bias, path)
    return out.reshape(*x.shape[:-1], n)
