"""The C++ prompt attention kernel (`kernels/cpu_prefill_attention.py`) against the PyTorch path it replaced,
on the same random inputs: packed MMLU-sized sequences of even and of uneven lengths (one SDPA call each, as
`PackedAttention` made them), 4 and 1 x 512 tokens (batched SDPA, as `EqualLengthAttention`) and 1 x 2,048.
Prints ms per call, alternating the two paths `--rounds` times, and the largest difference; where the kernel's
bf16 products run here (`cpu_prefill_attention.bf16_products`), the kernel with them too, and their largest
difference from the fp32 kernel.

    python scripts/bench_prompt_attention.py                 # the default model's heads: 9 / 3 kv, head_dim 64
    python scripts/bench_prompt_attention.py --heads 32 --kv-heads 8 --head-dim 64 --rounds 3
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from llmopt.kernels.cpu_prefill_attention import bf16_products, equal_length_segments, prefill_attention_kernel
from llmopt.kernels.paged_attention import attend, causal_mask

MMLU_LENS = [112, 97, 130, 88, 140, 101, 77, 120, 95, 105, 99, 110, 90, 85, 115, 100, 92, 80]  # 18 MMLU-sized
# an MMLU forward as the eval packs it: one long question beside short ones (a kernel splitting its work evenly by
# item count leaves a thread idle here)
MMLU_UNEVEN_LENS = [421, 197, 51, 52, 235, 62, 87, 154, 123, 155, 58, 45, 80, 63, 53, 45]


def sdpa_packed(q, k, v, lens):
    out, start = torch.empty_like(q), 0
    for n in lens:
        mask, is_causal = causal_mask(n, 0, None, q.device)
        out[start:start + n] = attend(q[start:start + n], k[start:start + n], v[start:start + n], mask, is_causal)
        start += n
    return out


def sdpa_batched(q, k, v, b, t):
    shape = lambda a: a.reshape(b, t, a.shape[1], a.shape[2]).transpose(1, 2)  # noqa: E731
    out = F.scaled_dot_product_attention(shape(q), shape(k), shape(v), is_causal=True, enable_gqa=True)
    return out.transpose(1, 2).reshape(b * t, q.shape[1], q.shape[2])


def timed(fn, iters: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    kernel = prefill_attention_kernel()
    if kernel is None:
        raise SystemExit("the CPU kernels could not be built here")
    gen = torch.Generator().manual_seed(0)
    cases = [("18 sequences of 77-140 tokens, one SDPA call each", MMLU_LENS, None),
             ("16 sequences of 45-421 tokens, one SDPA call each", MMLU_UNEVEN_LENS, None),
             ("4 x 512 tokens, batched SDPA", [512] * 4, 4), ("1 x 512 tokens", [512], 1), ("1 x 2,048 tokens", [2048], 1)]
    for name, lens, batched in cases:
        total = sum(lens)
        q = torch.randn(total, args.heads, args.head_dim, generator=gen)
        k, v = (torch.randn(total, args.kv_heads, args.head_dim, generator=gen) for _ in range(2))
        starts = torch.tensor([0, *lens[:-1]]).cumsum(0).tolist()
        segments = (equal_length_segments(batched, lens[0]) if batched else
                    torch.tensor([[s, n, 0, 0, s] for s, n in zip(starts, lens)]))
        ref = (lambda: sdpa_batched(q, k, v, batched, lens[0])) if batched else (lambda: sdpa_packed(q, k, v, lens))
        ker = lambda: kernel(q, k, v, segments, args.head_dim ** -0.5, 0)  # noqa: E731
        diff = (ref() - ker()).abs().max().item()
        times = [(timed(ref, args.iters), timed(ker, args.iters)) for _ in range(args.rounds)]
        cells = ", ".join(f"SDPA {a:.2f} ms / kernel {b:.2f} ms ({a / b:.2f}x)" for a, b in times)
        print(f"{name}: {cells}; max |difference| {diff:.1e}", flush=True)
        if bf16_products():
            ker16 = lambda: kernel(q, k, v, segments, args.head_dim ** -0.5, 0, True)  # noqa: E731
            diff16 = (ker() - ker16()).abs().max().item()
            times = [(timed(ker, args.iters), timed(ker16, args.iters)) for _ in range(args.rounds)]
            cells = ", ".join(f"fp32 {a:.2f} ms / bf16 {b:.2f} ms ({a / b:.2f}x)" for a, b in times)
            print(f"  the kernel's products in fp32 / bf16: {cells}; max |difference| {diff16:.1e}", flush=True)


if __name__ == "__main__":
    main()
