"""4-bit (and 8-bit) weight x fp32 activation linear layers on CPU, in C++ (`csrc/int4_linear.cpp`).

AWQ and GPTQ checkpoints store 4-bit codes with a scale and zero point per group of input columns.
`repack_int4` (`repack_int4_rows`: a slab of output rows at a time) turns such codes, once at load,
into the layout the kernel streams: output rows in tiles of 8 (padded with zero rows), each tile's
32-column blocks as 128 bytes interleaved so one 32-byte load holds 4 codes of each of the 8 rows
(low nibbles: columns 4c..4c+3, high nibbles: 16 + 4c..), and per group the 8 rows' scales and
zero points side by side (the kernel's header comment says why): fp16 scales and uint8 zeros where
the checkpoint's are such values (AWQ, GPTQ and Q4_0 store fp16 scales and integer zeros), else
fp32 scales and fp32 scale * zero; the kernel gives bitwise the same results from either. Act-order (GPTQ `desc_act`)
weights get their input columns sorted by group once here, and the kernel reads the activations
through that permutation; per-channel weights are one group as wide as the row.

`repack_int8` quantizes an fp32 weight to 8 bits per 32 columns (llama.cpp's Q8_0, which
its own GGUF files use for the vocabulary projection) in the same tiled order, for
`int8_linear`.

The kernels quantize activations to int8 per 32 values (scale = max|x| / 127) and take
integer dot products on the SIMD path `cpu_extension.cpu_isa()` names (AVX2; AVX-512 VNNI;
AMX-INT8 tiles for prompt chunks), every path bitwise the same outputs (the kernel's header
comment says why); `reference_int4_linear` is the same computation in PyTorch, and
`dequantize` the plain fp32 weights the PyTorch fallback multiplies by.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from llmopt.kernels.cpu_extension import cpu_ops

BLOCK = 32  # activation quantization block, and the unit groups are made of
TILE = 8  # output rows interleaved together


@dataclass
class PackedInt4:
    codes: torch.Tensor  # uint8 [ceil(N / 8), K * 4]
    scales: torch.Tensor  # [ceil(N / 8), K / group_size, 8]: fp16 (compact), or fp32
    zeros: torch.Tensor  # [ceil(N / 8), K / group_size, 8]: uint8 zero (compact), or fp32 scale * zero
    out_features: int
    group_size: int  # a multiple of 32
    perm: torch.Tensor | None  # int64 [K]: column k of the codes multiplies x[:, perm[k]]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] // 4

    @property
    def compact(self) -> bool:
        return self.scales.dtype == torch.float16

    def scaled_zeros(self) -> torch.Tensor:
        """fp32 scale * zero, [ceil(N / 8), K / group_size, 8] (exact from the compact layout too)."""
        return self.scales.float() * self.zeros.float() if self.compact else self.zeros


def _tiled(rows: torch.Tensor, n: int) -> torch.Tensor:
    """[N, groups] -> [ceil(N / 8), groups, 8], zero rows appended."""
    padded = torch.zeros(-(-n // TILE) * TILE, rows.shape[1], dtype=rows.dtype)
    padded[:n] = rows
    return padded.reshape(-1, TILE, rows.shape[1]).transpose(1, 2).contiguous()


# codes per slab of output rows repacked at a time: a few MB of temporaries, never a whole projection's
SLAB_CODES = 1 << 22


def repack_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor) -> PackedInt4 | None:
    """Codes [N, K] (0..15), scales and zero points [N, groups], the group of each input
    column [K] -> the kernel's layout; None where the kernel cannot take the weight (K not a
    multiple of 32, or a group boundary inside a block of 32 columns)."""
    return repack_int4_rows(lambda start, stop: codes[start:stop], tuple(codes.shape), scales, zeros, g_idx)


def repack_int4_rows(code_rows: Callable[[int, int], torch.Tensor], shape: tuple[int, int], scales: torch.Tensor,
                     zeros: torch.Tensor, g_idx: torch.Tensor) -> PackedInt4 | None:
    """`repack_int4` of the [N, K] codes `code_rows(start, stop)` gives a slab of output rows at a
    time (rows start..stop-1): tiles are repacked independently, so the layout is the same while
    only a slab of codes (`SLAB_CODES`) and its temporaries exist at once."""
    n, k = shape
    if k % BLOCK or n * k == 0:
        return None
    g = g_idx.long()
    perm = None
    if not torch.equal(g, torch.sort(g, stable=True).values):  # act-order: sort the columns by group once
        perm = torch.argsort(g, stable=True)
        g = g[perm]
    block_groups = g.reshape(k // BLOCK, BLOCK)
    if not bool((block_groups == block_groups[:, :1]).all()):
        return None
    counts = torch.unique_consecutive(g, return_counts=True)[1]
    if bool((counts == counts[0]).all()) and torch.equal(torch.unique_consecutive(g), torch.arange(len(counts))):
        group_size, scales, zeros = int(counts[0]), scales[:, : len(counts)], zeros[:, : len(counts)]
    else:  # uneven groups (or unused group ids): one scale per block of 32 columns
        group_size = BLOCK
        scales, zeros = scales[:, block_groups[:, 0]], zeros[:, block_groups[:, 0]]
    tiles = -(-n // TILE)
    packed = torch.empty(tiles, k * 4, dtype=torch.uint8)
    step = max(1, SLAB_CODES // (TILE * k))  # tiles per slab
    for first in range(0, tiles, step):
        last = min(first + step, tiles)
        start, stop = first * TILE, min(last * TILE, n)
        codes = code_rows(start, stop)
        if perm is not None:
            codes = codes[:, perm]
        c = torch.zeros((last - first) * TILE, k, dtype=torch.uint8)
        c[: stop - start] = codes.to(torch.uint8)
        # [tile, row, block, half, chunk, byte] -> bytes ordered [tile, block, chunk, row, byte]
        c = c.reshape(last - first, TILE, k // BLOCK, 2, 4, 4)
        packed[first:last] = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(-1, k * 4)
    scales, zeros = _scales_and_zeros(scales, zeros)
    return PackedInt4(packed, _tiled(scales, n), _tiled(zeros, n), n, group_size, perm)


def _scales_and_zeros(scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The compact pair (fp16 scales, uint8 zeros) where every scale is an fp16 value and every zero an
    integer in 0..255, else (fp32 scales, fp32 scale * zero)."""
    s32, z32 = scales.float(), zeros.float()
    half = s32.to(torch.float16)
    if torch.equal(half.float(), s32) and bool(((z32 >= 0) & (z32 <= 255) & (z32 == z32.round())).all()):
        return half, z32.to(torch.uint8)
    return s32, s32 * z32


def _rows(tiled: torch.Tensor, n: int) -> torch.Tensor:
    """[ceil(N / 8), groups, 8] -> [N, groups]."""
    return tiled.transpose(1, 2).reshape(-1, tiled.shape[1])[:n]


def unpack_codes(packed: PackedInt4) -> torch.Tensor:
    """The codes [N, K] in the packed column order."""
    tiles, k = packed.codes.shape[0], packed.in_features
    b = packed.codes.reshape(tiles, k // BLOCK, 4, TILE, 4)  # tile, block, chunk, row, byte
    halves = torch.stack([b & 0x0F, b >> 4], dim=2)  # tile, block, half, chunk, row, byte
    return halves.permute(0, 4, 1, 2, 3, 5).reshape(tiles * TILE, k)[: packed.out_features]


def _dequantized_packed_order(packed: PackedInt4, dtype: torch.dtype) -> torch.Tensor:
    w = unpack_codes(packed).to(dtype)
    n, k = w.shape
    scales, zeros = _rows(packed.scales.float(), n).to(dtype), _rows(packed.scaled_zeros(), n).to(dtype)
    return (w.reshape(n, k // packed.group_size, packed.group_size) * scales[..., None] - zeros[..., None]).reshape(n, k)


def dequantize(packed: PackedInt4) -> torch.Tensor:
    """fp32 weights [N, K] in the original column order."""
    w = _dequantized_packed_order(packed, torch.float32)
    if packed.perm is not None:
        w = torch.empty_like(w).index_copy_(1, packed.perm, w)
    return w


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 -> (int8 codes as fp32 [M, K / 32, 32], scales [M, K / 32, 1]), as the kernel does."""
    blocks = x.float().reshape(x.shape[0], -1, BLOCK)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return (blocks * inv).round(), d


def reference_int4_linear(x: torch.Tensor, packed: PackedInt4, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's computation in PyTorch (float64 sums): int8 activations per 32 values."""
    if packed.perm is not None:
        x = x[:, packed.perm]
    q, d = quantize_activations(x)
    w = _dequantized_packed_order(packed, torch.float64)
    y = ((q.double() * d.double()).reshape(x.shape[0], w.shape[1]) @ w.T).float()
    return y if bias is None else y + bias


def int4_linear_kernel() -> Callable | None:
    """`int4_linear(x [M, K] fp32, codes, scales, zeros, out_features, group_size, perm=None, bias=None)`,
    or None where the CPU kernels cannot be built (then multiply by `dequantize`d weights)."""
    ops = cpu_ops()
    return None if ops is None else ops.int4_linear


@dataclass
class PackedInt8:
    codes: torch.Tensor  # int8 [ceil(N / 8), K * 8]
    scales: torch.Tensor  # fp32 [ceil(N / 8), K / 32, 8]
    out_features: int

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] // TILE


def repack_int8(w: torch.Tensor) -> PackedInt8 | None:
    """fp32 (or 16-bit) [N, K] -> 8-bit codes with one scale per row and 32 columns (scale = max|w| / 127,
    codes = round(w / scale), as llama.cpp's Q8_0); None when K is not a multiple of 32."""
    n, k = w.shape
    if k % BLOCK or w.numel() == 0:
        return None
    tiles = -(-n // TILE)
    codes = torch.empty(tiles, k * TILE, dtype=torch.int8)
    scales = torch.empty(n, k // BLOCK)
    # a few MB of rows at a time: the whole-matrix temporaries of a vocabulary projection would be
    # several times its fp32 size (GBs at 8B) on top of the weight itself
    step = TILE * max(1, (1 << 20) // (k * TILE))
    for start in range(0, tiles * TILE, step):
        stop = min(start + step, n)
        q, d = quantize_activations(w[start:stop].float())  # the same rounding as the activations
        chunk = torch.zeros(min(step, tiles * TILE - start), k, dtype=torch.int8)
        chunk[: stop - start] = q.reshape(stop - start, k).to(torch.int8)
        # [tile, row, block, chunk, byte] -> [tile, block, chunk, row, byte]
        codes[start // TILE: start // TILE + chunk.shape[0] // TILE] = \
            chunk.reshape(-1, TILE, k // BLOCK, 8, 4).permute(0, 2, 3, 1, 4).reshape(-1, k * TILE)
        scales[start:stop] = d.reshape(stop - start, k // BLOCK)
    return PackedInt8(codes, _tiled(scales, n), n)


def dequantize_int8(packed: PackedInt8) -> torch.Tensor:
    """fp32 weights [N, K]."""
    tiles, k = packed.codes.shape[0], packed.in_features
    codes = packed.codes.reshape(tiles, k // BLOCK, 8, TILE, 4).permute(0, 3, 1, 2, 4).reshape(tiles * TILE, k)
    n = packed.out_features
    return (codes[:n].float().reshape(n, k // BLOCK, BLOCK) * _rows(packed.scales, n)[..., None]).reshape(n, k)


def reference_int8_linear(x: torch.Tensor, packed: PackedInt8) -> torch.Tensor:
    """The int8 kernel's computation in PyTorch (float64 sums)."""
    q, d = quantize_activations(x)
    return ((q.double() * d.double()).reshape(x.shape[0], -1) @ dequantize_int8(packed).double().T).float()


def int8_linear_kernel() -> Callable | None:
    """`int8_linear(x [M, K] fp32, codes, scales, out_features)`, or None where the CPU kernels
    cannot be built."""
    ops = cpu_ops()
    return None if ops is None else ops.int8_linear
