#!/usr/bin/env bash
# Run on a lent GPU machine (device tool): install, GPU tests, a short throughput run.
# Writes results to $OUT (or ./gpu-results). Keep well inside 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
TORCH_VERSION=${TORCH_VERSION:-2.13.0} bash scripts/setup.sh > "$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
. .venv/bin/activate
export HF_HUB_OFFLINE=1 LLMOPT_CACHE="$PWD/.llmopt-cache"
timeout 300 pytest -q -m gpu tests/test_gpu.py 2>&1 | tee "$OUT/pytest-gpu.txt"
timeout 120 llmopt generate default --device cuda --dtype bfloat16 -p "What is the capital of France?" \
  --temperature 0 --max-tokens 32 --json > "$OUT/generate.json" 2> "$OUT/generate.err"
echo "done; results in $OUT"
