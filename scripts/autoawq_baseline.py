#!/usr/bin/env python
"""AutoAWQ baseline: time AutoAWQ's real AWQ quantization of a Hugging Face folder.

A side-by-side reference for llmopt's own AWQ quantizer. AutoAWQ (autoawq 0.2.9, the
last release; deprecated) is NOT a dependency of llmopt: run this with a separate
scratch venv, e.g.

    python3 -m venv /tmp/awqtest
    /tmp/awqtest/bin/pip install torch==2.13.0 transformers==5.24.0 datasets==5.2.0
    /tmp/awqtest/bin/pip install --no-deps autoawq==0.2.9 accelerate==1.15.0 psutil==7.2.2

(`--no-deps` for autoawq keeps pip from pulling triton / a CUDA torch; AutoAWQ's imports
need only accelerate (+psutil) and datasets on top of torch/transformers.)

Two modes:

  # 1. write a deterministic calibration file from MMLU questions (needs only `tokenizers`)
  python scripts/autoawq_baseline.py make-calib --model MODEL_DIR \
      --mmlu /work/shared/data/mmlu/test.jsonl.gz --out /tmp/calib_64x256.jsonl

  # 2. quantize with AutoAWQ, print one JSON line of timings/peak RSS on stdout
  /tmp/awqtest/bin/python scripts/autoawq_baseline.py quantize --model MODEL_DIR \
      --calib /tmp/calib_64x256.jsonl --out /tmp/autoawq-smollm2-w4g64

Calibration file (.jsonl): one object per line, either {"text": "..."} or
{"input_ids": [int, ...]}. Texts are tokenized with the model's tokenizer
(`tokenizer.encode`, AutoAWQ's own call) and truncated to --max-calib-seq-len tokens, then
handed to AutoAWQ as a list of token-id lists. This matters: AutoAWQ's
`get_calib_dataset` does not truncate - it silently DROPS every sample longer than
max_calib_seq_len, concatenates the rest and re-cuts it into max_calib_seq_len blocks, so
64 texts of >256 tokens passed as strings would leave it with nothing (torch.cat error).
With 64 samples of exactly 256 ids AutoAWQ calibrates on exactly 64 blocks x 256 tokens.
`--raw-text` hands the strings over unchanged instead (AutoAWQ's behaviour, for comparison).

Everything AutoAWQ prints goes to stderr; stdout carries only the JSON result line.
"""
from __future__ import annotations

import time

_T_START = time.perf_counter()

import argparse
import contextlib
import gzip
import json
import platform
import resource
import sys
from pathlib import Path

QUANT_CONFIG = {"zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMM"}


def _peak_rss_mb() -> dict:
    """ru_maxrss is in KiB on Linux. RUSAGE_CHILDREN is the largest waited-for child."""
    self_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    child_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {
        "peak_rss_self_mb": round(self_kb / 1024, 1),
        "peak_rss_children_mb": round(child_kb / 1024, 1),
        "peak_rss_mb": round(max(self_kb, child_kb) / 1024, 1),
    }


# ---------------------------------------------------------------- make-calib


def make_calib(args) -> int:
    """Deterministic: every --stride-th MMLU question in file order (spreads over subjects), each as "question\\nA. ..\\nB. .." with the
    answer choices, joined by blank lines; a sample is closed as soon as it reaches
    --seq-len tokens (model tokenizer, no special tokens), so every text has >= seq-len tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))
    opener = gzip.open if str(args.mmlu).endswith(".gz") else open
    samples: list[str] = []
    parts: list[str] = []
    with opener(args.mmlu, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if len(samples) == args.n:
                break
            if i % args.stride:
                continue
            row = json.loads(line)
            choices = "\n".join(f"{'ABCD'[i]}. {c}" for i, c in enumerate(row.get("choices", [])))
            parts.append(f"{row['question'].strip()}\n{choices}".strip())
            text = "\n\n".join(parts)
            if len(tok.encode(text, add_special_tokens=False).ids) >= args.seq_len:
                samples.append(text)
                parts = []
    if len(samples) < args.n:
        print(f"only {len(samples)} samples of >= {args.seq_len} tokens in {args.mmlu}", file=sys.stderr)
        return 1
    with open(args.out, "w", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps({"text": s}, ensure_ascii=False) + "\n")
    lens = [len(tok.encode(s, add_special_tokens=False).ids) for s in samples]
    print(json.dumps({"calib": str(args.out), "n": len(samples), "min_tokens": min(lens),
                      "max_tokens": max(lens), "total_tokens": sum(lens)}))
    return 0


# ---------------------------------------------------------------- quantize


def cpu_safe_quantizer_cls():
    """AwqQuantizer with AutoAWQ 0.2.9's CPU-only scale-search bug fixed.

    `_compute_best_scale` snapshots the block with `{k: v.cpu() for k, v in
    module.state_dict().items()}` and restores it after each of its 20 grid points. On CPU
    `.cpu()` returns the SAME tensor, and the first grid point's in-place
    `fc.weight.mul_(scales)` writes into that "snapshot": every later grid point is scored on
    W*s0 instead of W, and the block is left holding W*s0 (s0 = the ratio-0 scales) when
    `apply_scale` multiplies the chosen scales in - so every scaled linear ends up with an
    extra per-input-channel factor and the checkpoint is garbage (on CUDA `.cpu()` copies,
    so GPU runs are fine). The fix: make that one state_dict() call return clones.
    """
    from awq.quantize.quantizer import AwqQuantizer

    class CpuSafeAwqQuantizer(AwqQuantizer):
        def _compute_best_scale(self, x, w_mean, x_mean, module2inspect, linears2scale,
                                fp16_output, kwargs={}):
            real = module2inspect.state_dict
            module2inspect.state_dict = lambda *a, **k: {
                n: t.detach().clone() for n, t in real(*a, **k).items()}
            try:
                return super()._compute_best_scale(x, w_mean, x_mean, module2inspect,
                                                   linears2scale, fp16_output, kwargs)
            finally:
                del module2inspect.state_dict  # drop the instance attribute again

    return CpuSafeAwqQuantizer



def load_calib(path: str, tokenizer, max_len: int, raw_text: bool):
    rows = [json.loads(l) for l in Path(path).read_text(encoding="utf-8").splitlines() if l.strip()]
    if not rows:
        raise SystemExit(f"{path}: no calibration samples")
    if raw_text:
        if not all("text" in r for r in rows):
            raise SystemExit("--raw-text needs {'text': ...} rows")
        return [r["text"] for r in rows], "text (raw, AutoAWQ drops samples > max_calib_seq_len)"
    out: list[list[int]] = []
    for r in rows:
        if "input_ids" in r:
            ids = [int(i) for i in r["input_ids"]]
        else:
            ids = tokenizer.encode(r["text"].strip())  # AutoAWQ's own call (add_special_tokens default)
        out.append(ids[:max_len])
    return out, "token ids (text tokenized and truncated by this script)"


def quantize(args) -> int:
    t_import = time.perf_counter()
    # AutoAWQ and transformers log/print freely: keep stdout for the JSON line only.
    real_stdout = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        import warnings

        warnings.simplefilter("ignore", DeprecationWarning)
        import torch
        import transformers
        import awq
        from awq import AutoAWQForCausalLM
        from transformers import AutoTokenizer

        if args.threads:
            torch.set_num_threads(args.threads)
        import_s = time.perf_counter() - t_import

        t = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        dtype = getattr(torch, args.dtype)
        model = AutoAWQForCausalLM.from_pretrained(args.model, torch_dtype=dtype, device_map=args.device_map)
        load_s = time.perf_counter() - t

        calib, calib_kind = load_calib(args.calib, tokenizer, args.max_calib_seq_len, args.raw_text)

        t = time.perf_counter()
        model.quantize(
            tokenizer,
            quant_config=dict(QUANT_CONFIG),
            calib_data=calib,
            n_parallel_calib_samples=args.n_parallel_calib_samples,
            max_calib_samples=args.max_calib_samples,
            max_calib_seq_len=args.max_calib_seq_len,
            **({} if args.stock else {"quantizer_cls": cpu_safe_quantizer_cls()}),
        )
        quantize_s = time.perf_counter() - t

        t = time.perf_counter()
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        if args.save_dtype and args.save_dtype != args.dtype:
            # Only floating tensors change (embeddings, norms, lm_head, biases); the WQLinear
            # int32 qweight/qzeros stay, its scales are float16 already whatever --dtype was.
            save_dtype = getattr(torch, args.save_dtype)
            model.model.to(save_dtype)
            model.model.config.dtype = save_dtype
        model.save_quantized(str(out))
        tokenizer.save_pretrained(str(out))
        save_s = time.perf_counter() - t

    cfg = json.loads((out / "config.json").read_text())
    result = {
        "tool": "autoawq",
        "autoawq": getattr(awq, "__version__", "?"),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "model": str(args.model),
        "calib": str(args.calib),
        "calib_format": calib_kind,
        "calib_rows": len(calib),
        "quant_config": QUANT_CONFIG,
        "cpu_scale_bug_fixed": not args.stock,
        "dtype": args.dtype,
        "save_dtype": args.save_dtype or args.dtype,
        "n_parallel_calib_samples": args.n_parallel_calib_samples,
        "max_calib_samples": args.max_calib_samples,
        "max_calib_seq_len": args.max_calib_seq_len,
        "import_s": round(import_s, 2),
        "load_s": round(load_s, 2),
        "quantize_s": round(quantize_s, 2),
        "save_s": round(save_s, 2),
        "total_s": round(time.perf_counter() - _T_START, 2),
        **_peak_rss_mb(),
        "out": str(out),
        "out_files": sorted(p.name for p in out.iterdir()),
        "quantization_config": cfg.get("quantization_config"),
    }
    print(json.dumps(result), file=real_stdout, flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    q = sub.add_parser("quantize", help="run AutoAWQ quantize + save_quantized, print a JSON line")
    q.add_argument("--model", required=True, help="Hugging Face model folder")
    q.add_argument("--calib", required=True, help=".jsonl: {'text': ...} or {'input_ids': [...]} per line")
    q.add_argument("--out", required=True, help="output folder for save_quantized")
    q.add_argument("--n-parallel-calib-samples", type=int, default=16,
                   help="samples per forward during calibration (AutoAWQ: None = all at once)")
    q.add_argument("--max-calib-samples", type=int, default=64)
    q.add_argument("--max-calib-seq-len", type=int, default=256)
    q.add_argument("--raw-text", action="store_true",
                   help="pass texts to AutoAWQ unchanged (it drops samples longer than max-calib-seq-len)")
    q.add_argument("--stock", action="store_true",
                   help="run AutoAWQ's quantizer unpatched (on CPU it writes corrupted weights, see "
                        "cpu_safe_quantizer_cls); by default a one-line CPU fix is applied (same cost)")
    q.add_argument("--device-map", default="auto", help="passed to from_pretrained (AutoAWQ default 'auto')")
    q.add_argument("--dtype", default="float16", choices=["float16", "float32", "bfloat16"],
                   help="torch_dtype the model is loaded and calibrated in (AutoAWQ's default: float16). On an "
                        "AVX2-only CPU an fp16 matmul is ~50x slower than fp32 (microbenchmark); float32 is the "
                        "sensible CPU baseline, with --save-dtype float16 for AutoAWQ's usual checkpoint")
    q.add_argument("--save-dtype", default=None, choices=["float16", "float32", "bfloat16"],
                   help="cast the non-quantized tensors to this before save_quantized (default: --dtype); "
                        "--dtype float32 --save-dtype float16 gives AutoAWQ's usual all-fp16 checkpoint")
    q.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = torch default)")
    q.set_defaults(func=quantize)

    c = sub.add_parser("make-calib", help="write N MMLU-question texts of >= SEQ_LEN tokens as .jsonl")
    c.add_argument("--model", required=True, help="model folder (its tokenizer.json counts tokens)")
    c.add_argument("--mmlu", default="/work/shared/data/mmlu/test.jsonl.gz")
    c.add_argument("--out", required=True)
    c.add_argument("--n", type=int, default=64)
    c.add_argument("--seq-len", type=int, default=256)
    c.add_argument("--stride", type=int, default=37, help="take every STRIDE-th question")
    c.set_defaults(func=make_calib)

    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
