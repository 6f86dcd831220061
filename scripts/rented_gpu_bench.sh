#!/usr/bin/env bash
# One command on a freshly rented GPU box: install llmopt, run `bench throughput` and `bench latency` on MODEL,
# and leave one folder to copy home (results.json, report.md and plots per benchmark, plus nvidia-smi and
# the install log).
#   bash scripts/rented_gpu_bench.sh MODEL [OUT_DIR]        # MODEL: default, a hub id, a folder or a .gguf
# Environment: ENGINES (default "hf-batch,llmopt,vllm": vLLM is used where installed, skipped otherwise),
# BATCH_SIZES (default "1,8,32"), NUM_PROMPTS (default 256), DTYPE (default bfloat16), EXTRA_BENCH_ARGS.
set -euo pipefail
MODEL=${1:?usage: bash scripts/rented_gpu_bench.sh MODEL [OUT_DIR]}
OUT=$(realpath -m "${2:-bench-results-$(date +%Y%m%d-%H%M%S)}")
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || echo "no nvidia-smi: running on CPU" | tee "$OUT/nvidia-smi.txt"
EXTRAS=bench bash scripts/setup.sh > "$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
. .venv/bin/activate
DEVICE=$(python -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
DTYPE=${DTYPE:-$([ "$DEVICE" = cuda ] && echo bfloat16 || echo auto)}
set -x
llmopt bench throughput "$MODEL" --engines "${ENGINES:-hf-batch,llmopt,vllm}" --num-prompts "${NUM_PROMPTS:-256}" \
  --device "$DEVICE" --dtype "$DTYPE" -o "$OUT/throughput" ${EXTRA_BENCH_ARGS:-} | tee "$OUT/throughput.txt"
llmopt bench latency "$MODEL" --batch-size "${BATCH_SIZES:-1,8,32}" --device "$DEVICE" --dtype "$DTYPE" \
  -o "$OUT/latency" ${EXTRA_BENCH_ARGS:-} | tee "$OUT/latency.txt"
set +x
echo "results in $OUT (copy it home: scp -r host:$OUT .)"
