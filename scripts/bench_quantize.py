"""Quantization wall time and peak RSS, llmopt vs AutoAWQ, side by side on one machine.

Each run is a separate process, one after another, on the same model folder and the same
calibration samples (64 x 256 tokens, group size 64):

    python scripts/autoawq_baseline.py make-calib --model MODEL_DIR --mmlu ../shared/data/mmlu/test.jsonl.gz \\
        --out /tmp/calib_64x256.jsonl
    python scripts/bench_quantize.py --calib /tmp/calib_64x256.jsonl --autoawq-python /tmp/awqtest/bin/python

(AutoAWQ lives in its own venv: see scripts/autoawq_baseline.py.) Prints one JSON line
per run and a table; wall time is the whole command (process start to exit).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path


def run(label: str, cmd: list[str]) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"{label} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    doc = json.loads(proc.stdout.strip().splitlines()[-1] if label == "AutoAWQ" else proc.stdout)
    # peak RSS as each process measured it itself (RUSAGE_CHILDREN keeps the maximum over all children so far)
    row = {"run": label, "wall_s": round(wall, 1), "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1),
           "command": " ".join(cmd)}
    if label != "AutoAWQ":
        row.update(quantize_s=doc["quantize_seconds"], peak_rss_mib=round(doc["peak_rss_bytes"] / 2**20),
                   mean_layer_error=doc["mean_relative_error"])
    else:
        row.update(quantize_s=doc.get("quantize_s"), peak_rss_mib=round(doc["peak_rss_mb"]))
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--calib", required=True)
    ap.add_argument("--out", default="/tmp/bench-quantize")
    ap.add_argument("--autoawq-python", help="python of a venv with autoawq (skipped when not given)")
    ap.add_argument("--methods", default="awq,gptq")
    ap.add_argument("--autoawq-dtype", default="float32", choices=["float16", "float32", "bfloat16"],
                    help="dtype AutoAWQ calibrates in (float32: fp16 matmuls are far slower on CPU; the "
                         "checkpoint is saved in float16 either way, AutoAWQ's usual output)")
    args = ap.parse_args()
    out = Path(args.out)
    llmopt = str(Path(sys.executable).with_name("llmopt"))
    rows = []
    for method in args.methods.split(","):
        rows.append(run(f"llmopt {method}", [llmopt, "quantize", args.model, "--method", method, "-o", str(out / method),
                                             "--calib", args.calib, "--num-samples", "64", "--seq-len", "256",
                                             "--group-size", "64", "--overwrite", "--json"]))
    if args.autoawq_python:
        from llmopt.core import resolve

        folder = resolve(args.model).path
        script = Path(__file__).with_name("autoawq_baseline.py")
        rows.append(run("AutoAWQ", [args.autoawq_python, str(script), "quantize", "--model", str(folder),
                                    "--calib", args.calib, "--out", str(out / "autoawq"),
                                    "--dtype", args.autoawq_dtype, "--save-dtype", "float16"]))
    print(f"\n{'run':12} {'wall s':>8} {'quantize s':>11} {'CPU s':>8} {'peak RSS MiB':>13}")
    for r in rows:
        print(f"{r['run']:12} {r['wall_s']:8.1f} {r['quantize_s'] or 0:11.1f} {r['cpu_s']:8.1f} {r['peak_rss_mib']:13}")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
