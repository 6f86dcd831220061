"""Issue 27's acceptance rows on this CPU in one run: llmopt against llama.cpp's own `llama-bench` (batch-1
decode, pp512, the roofline's MBU), and optionally against `llama-server` (serving sweep), the default gate
stage cold and the AVX2 path forced. Prints each acceptance line with its figure and whether it holds, and
writes every command's results.json under --out with a summary.json beside them.

    python scripts/cpu_peer_check.py --awq AWQ --q4-0 Q4_0.gguf --out /tmp/peer
    python scripts/cpu_peer_check.py --awq AWQ --q4-0 Q4_0.gguf --rtn RTN --serving --out /tmp/peer

The checkpoints (the default model each time): AWQ `llmopt quantize default --method awq --output AWQ`,
Q4_0.gguf `llmopt quantize default --method gguf --gguf-type Q4_0 --output Q4_0.gguf`, RTN `llmopt quantize
default --method rtn --output RTN`; BF16.gguf `--gguf-type BF16` instead of Q4_0. llama.cpp's binaries: `bash
scripts/build_llama_cpp.sh`. `--rtn` adds the gate stage (`llmopt eval RTN --baseline default --tasks ppl,kld,mmlu
--no-cache`, timed; RTN fails the KLD gate, exit 1, which is expected) and the AVX2 path forced (`LLMOPT_CPU_ISA=avx2`,
figures only: its bar is "no regression" against earlier figures in docs/benchmarks.md). `--bf16` adds llama-bench on
a BF16 GGUF of the same weights, the like-for-like peer of llmopt's fp32 prefill (figures only). The commands run one
after another, so the rows of one command are side by side and those of different commands minutes apart: on a
shared VM read several runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from llmopt.core.embedded import default_gguf_path

TARGETS = {"tg": 1.3, "pp_ratio": 2.0, "pp_tok_s": 1500.0, "mbu_b1": 0.75, "mbu_b8": 0.50, "serve_ratio": 1.5,
           "gate_s": 180.0}


def fail(message: str) -> None:
    """A run that cannot go on: the reason on stderr, exit 2 (exit 1 is a gate's verdict in llmopt)."""
    print(f"cpu_peer_check.py: {message}", file=sys.stderr)
    sys.exit(2)


def llmopt_cli(args: list[str], out: Path, env: dict[str, str] | None = None) -> dict[str, Any] | None:
    """`llmopt ARGS -o OUT` (a bench command); its results.json, None if it wrote none."""
    command = ["llmopt", *args, "-o", str(out)]
    print("$ " + shlex.join(command), flush=True)
    subprocess.run(command, check=False, env={**os.environ, **(env or {})})
    path = out / "results.json"
    return json.loads(path.read_text()) if path.exists() else None


def latency(name: str, model: str, engines: str, batches: str, input_len: int, out: Path, threads: int,
            extra: tuple[str, ...] = (), env: dict[str, str] | None = None) -> dict[str, Any]:
    document = llmopt_cli(["bench", "latency", model, "--engines", engines, "--batch-size", batches,
                              "--input-len", str(input_len), "--output-len", "128", "--threads", str(threads),
                              *extra], out / name, env)
    if document is None:
        fail(f"{name}: bench latency wrote no results (see its output above)")
    return document


def llmopt_row(document: dict[str, Any], batch: int) -> dict[str, Any]:
    return next(r for r in document["runs"] if r["engine"] == "llmopt" and r.get("batch_size") == batch
                and not r.get("skipped"))


def llama_rows(document: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """llama-bench's ppN + tgN row and its tgN @ dN row; exits where llama-bench did not run."""
    runs = [r for r in document["runs"] if r["engine"] == "llama.cpp"]
    if not runs or runs[0].get("skipped") or "llama-bench" not in runs[0]["label"]:
        fail(f"llama-bench did not run: {runs[0].get('skipped') if runs else 'no llama.cpp row'} "
             "(build it: bash scripts/build_llama_cpp.sh)")
    fresh = next(r for r in runs if r.get("pp_tok_s") is not None)
    deep = next(r for r in runs if r.get("pp_tok_s") is None)
    return fresh, deep


def serving(awq: str, out: Path) -> list[dict[str, Any]]:
    sweep = ["--sweep", "concurrency=1,4,16", "--num-prompts", "32", "--output-len", "64"]
    ours = llmopt_cli(["bench", "serve", "--model", awq, "--serve-args", "--max-num-seqs 64 --kv-cache-memory 1GiB",
                          *sweep], out / "serve-llmopt")
    peer = llmopt_cli(["bench", "serve", "--launch", "llama-server", "--model", "default", "--serve-args", "-np 16",
                          *sweep], out / "serve-llama-server")
    if ours is None or peer is None:
        fail("bench serve wrote no results (see its output above)")
    rows = []
    for run in ours["runs"]:
        other = next(r for r in peer["runs"] if r["label"] == run["label"])
        rows.append({"label": run["label"], "llmopt_tok_s": run["output_throughput"],
                     "llama_server_tok_s": other["output_throughput"],
                     "ratio": run["output_throughput"] / other["output_throughput"],
                     "llmopt_ttft_ms": run["median_ttft_ms"], "llama_server_ttft_ms": other["median_ttft_ms"],
                     "failed": [run["failed"], other["failed"]]})
    return rows


def gate_stage(rtn: str, out: Path) -> tuple[float, int]:
    command = ["llmopt", "eval", rtn, "--baseline", "default", "--tasks", "ppl,kld,mmlu", "--no-cache",
               "-o", str(out / "gate.json")]
    print("$ " + shlex.join(command), flush=True)
    start = time.perf_counter()
    code = subprocess.run(command, check=False).returncode
    return time.perf_counter() - start, code


@dataclass
class Line:
    item: str  # the acceptance item
    figure: str  # what was measured
    holds: bool | None  # None: figures without a target


def latency_lines(documents: dict[str, dict[str, Any]]) -> list[Line]:
    """The decode, prefill and MBU items from the bench latency documents (keys as main() names them)."""
    q41_fresh, q41_deep = llama_rows(documents["awq-q4_1"])
    q40_fresh, q40_deep = llama_rows(documents["q4_0"])
    b1, b8 = llmopt_row(documents["awq-q4_1"], 1), llmopt_row(documents["awq-q4_1"], 8)
    f1, short = llmopt_row(documents["fp32"], 1), llmopt_row(documents["awq-short"], 1)
    h1, h8 = llmopt_row(documents["awq-fp16kv"], 1), llmopt_row(documents["awq-fp16kv"], 8)
    h0 = llmopt_row(documents["awq-fp16kv-short"], 1)
    lines = []
    for what, ours, q40_row, q41_row, fp16 in (("at ~0 context", short, q40_fresh, q41_fresh, h0),
                                               ("after 512 tokens", b1, q40_deep, q41_deep, h1)):
        r0, r1 = ours["tg_tok_s"] / q40_row["tg_tok_s"], ours["tg_tok_s"] / q41_row["tg_tok_s"]
        lines.append(Line(f"tg128 {what}: AWQ >= {TARGETS['tg']}x llama-bench Q4_0 and Q4_1",
                          f"{ours['tg_tok_s']:.1f} tok/s: {r0:.2f}x Q4_0 ({q40_row['tg_tok_s']:.1f}), {r1:.2f}x "
                          f"Q4_1 ({q41_row['tg_tok_s']:.1f}); fp16 KV {fp16['tg_tok_s'] / q40_row['tg_tok_s']:.2f}x"
                          f" / {fp16['tg_tok_s'] / q41_row['tg_tok_s']:.2f}x", min(r0, r1) >= TARGETS["tg"]))
    peer_pp = max(q40_fresh["pp_tok_s"], q41_fresh["pp_tok_s"])
    for what, row in (("int4 (AWQ)", b1), ("fp32", f1)):
        ratio = row["pp_tok_s"] / peer_pp
        lines.append(Line(f"pp512 {what} >= {TARGETS['pp_ratio']}x llama-bench's Q4_0 / Q4_1 and >= "
                          f"{TARGETS['pp_tok_s']:,.0f} tok/s",
                          f"{row['pp_tok_s']:,.1f} tok/s, {ratio:.2f}x (llama-bench Q4_0 "
                          f"{q40_fresh['pp_tok_s']:,.1f}, Q4_1 {q41_fresh['pp_tok_s']:,.1f})",
                          ratio >= TARGETS["pp_ratio"] and row["pp_tok_s"] >= TARGETS["pp_tok_s"]))
    for what, row, fp16, target in (("batch 1 after 512", b1, h1, "mbu_b1"), ("batch 8", b8, h8, "mbu_b8")):
        lines.append(Line(f"MBU {what} >= {TARGETS[target]:.0%}",
                          f"{row['mbu']:.0%} (step {row['decode_step_ms']:.2f} ms, probe "
                          f"{row['read_bandwidth_gb_s']:.1f} GB/s); fp16 KV {fp16['mbu']:.0%} (probe "
                          f"{fp16['read_bandwidth_gb_s']:.1f})", row["mbu"] >= TARGETS[target]))
    if "bf16" in documents:
        peer = llama_rows(documents["bf16"])[0]["pp_tok_s"]
        lines.append(Line("pp512 fp32 beside llama-bench on a BF16 GGUF of the same weights (no target)",
                          f"{f1['pp_tok_s']:,.1f} vs {peer:,.1f} tok/s, {f1['pp_tok_s'] / peer:.2f}x; "
                          f"int4 {b1['pp_tok_s'] / peer:.2f}x", None))
    return lines


def serving_line(rows: list[dict[str, Any]]) -> Line:
    """The serving item from serving()'s rows (the last one the highest concurrency)."""
    return Line(f"serving: output tok/s >= {TARGETS['serve_ratio']}x llama-server at the top concurrency, median "
                "TTFT no worse at each",
                "; ".join(f"{r['label']}: {r['llmopt_tok_s']:.1f} vs {r['llama_server_tok_s']:.1f} tok/s "
                          f"({r['ratio']:.2f}x), TTFT {r['llmopt_ttft_ms']:.1f} vs {r['llama_server_ttft_ms']:.1f} "
                          f"ms, failed {r['failed'][0]} / {r['failed'][1]}" for r in rows),
                rows[-1]["ratio"] >= TARGETS["serve_ratio"]
                and all(r["llmopt_ttft_ms"] <= r["llama_server_ttft_ms"] for r in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--awq", required=True, help="the default model's AWQ w4 g64 folder")
    parser.add_argument("--q4-0", required=True, help="a Q4_0 GGUF of the default model's weights")
    parser.add_argument("--bf16", help="a BF16 GGUF of the same weights: llama-bench's bf16 prefill beside "
                        "llmopt's fp32 model (whose prompt products are bf16 on AVX512-BF16 / AMX CPUs)")
    parser.add_argument("--rtn", help="an RTN w4 folder of the default model: adds the gate stage and the AVX2 rows")
    parser.add_argument("--serving", action="store_true", help="add the serving sweep against llama-server")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True, help="a new folder for every command's results")
    args = parser.parse_args()
    if args.threads < 1:
        parser.error("--threads must be at least 1")
    for path in [args.awq, args.q4_0] + [p for p in (args.bf16, args.rtn) if p]:
        if not Path(path).exists():
            parser.error(f"{path} does not exist (see this script's help for how to make it)")
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"{args.out} is not empty")
    args.out.mkdir(parents=True, exist_ok=True)
    q4_1 = str(default_gguf_path())
    started = time.strftime("%H:%M:%S", time.gmtime())

    t, fp16 = args.threads, ("--kv-cache-dtype", "float16")
    documents = {
        "awq-q4_1": latency("awq-q4_1", args.awq, "llmopt,llama.cpp", "1,8", 512, args.out, t, ("--gguf", q4_1)),
        "q4_0": latency("q4_0", args.awq, "llama.cpp", "1", 512, args.out, t, ("--gguf", args.q4_0)),
        "fp32": latency("fp32", "default", "llmopt", "1,8", 512, args.out, t),
        "awq-short": latency("awq-short", args.awq, "llmopt", "1", 8, args.out, t),
        "awq-fp16kv": latency("awq-fp16kv", args.awq, "llmopt", "1,8", 512, args.out, t, fp16),
        "awq-fp16kv-short": latency("awq-fp16kv-short", args.awq, "llmopt", "1", 8, args.out, t, fp16),
    }
    if args.bf16:
        documents["bf16"] = latency("bf16", args.awq, "llama.cpp", "1", 512, args.out, t, ("--gguf", args.bf16))

    lines = latency_lines(documents)
    summary: dict[str, Any] = {"started_utc": started, "targets": TARGETS}
    if args.serving:
        rows = serving(args.awq, args.out)
        summary["serving"] = rows
        lines.append(serving_line(rows))
    if args.rtn:
        seconds, code = gate_stage(args.rtn, args.out)
        summary["gate"] = {"seconds": seconds, "exit_code": code}
        lines.append(Line(f"gate stage cold (ppl, kld, mmlu; fp32 baseline and candidate) <= {TARGETS['gate_s']:.0f} s",
                          f"{seconds:.1f} s, exit {code}", seconds <= TARGETS["gate_s"] and code in (0, 1)))
        avx2 = latency("avx2", args.rtn, "llmopt", "1,8", 512, args.out, t, env={"LLMOPT_CPU_ISA": "avx2"})
        a1, a8 = llmopt_row(avx2, 1), llmopt_row(avx2, 8)
        lines.append(Line("AVX2 path forced (compare with earlier figures)",
                          f"pp512 {a1['pp_tok_s']:,.1f} tok/s, batch-1 step {a1['decode_step_ms']:.2f} ms, batch-8 "
                          f"step {a8['decode_step_ms']:.2f} ms ({a1.get('cpu_kernels')})", None))

    summary["lines"] = [asdict(line) for line in lines]
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\nstarted {started} UTC, ended {time.strftime('%H:%M:%S', time.gmtime())} UTC")
    for line in lines:
        verdict = "-" if line.holds is None else "holds" if line.holds else "NOT MET"
        print(f"[{verdict}] {line.item}\n    {line.figure}")


if __name__ == "__main__":
    main()
