"""GPTQ's solve on one projection shape: wall time, CPU seconds, minor page faults, and a digest of
the codes, scales and zeros (equal digests across two commits = the same checkpoint bytes).

    python scripts/bench_gptq_solve.py 4096x14336          # OUT x IN: an 8B down_proj
    python scripts/bench_gptq_solve.py 2048x3072 --act-order

The weight is random; the Hessian comes from 2,048 random tokens with uneven channels (seed 0).
"""

from __future__ import annotations

import argparse
import hashlib
import resource
import time

import torch

from llmopt.quant import gptq
from llmopt.quant.quantizer import QuantScheme


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", help="OUTxIN, e.g. 4096x14336")
    parser.add_argument("--act-order", action="store_true")
    args = parser.parse_args()
    try:
        out_features, in_features = (int(v) for v in args.shape.lower().split("x"))
    except ValueError:
        parser.error(f"shape must be OUTxIN, got {args.shape!r}")
    torch.manual_seed(0)
    x = torch.randn(2048, in_features) * torch.rand(in_features) * 3
    w = torch.randn(out_features, in_features) * 0.02
    h = gptq.hessian(x)
    del x
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    q, _ = gptq.gptq_quantize(w, h, QuantScheme(bits=4, group_size=64, sym=False), args.act_order)
    after, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - start
    digest = hashlib.sha256(q.codes.numpy().tobytes() + q.scales.numpy().tobytes()
                            + q.zeros.numpy().tobytes()).hexdigest()[:16]
    print(f"{args.shape} act_order={args.act_order}: wall {wall:.1f} s, user {after.ru_utime - before.ru_utime:.1f} s, "
          f"sys {after.ru_stime - before.ru_stime:.1f} s, minor faults {(after.ru_minflt - before.ru_minflt) / 1e6:.2f} M, "
          f"digest {digest}")


if __name__ == "__main__":
    main()
