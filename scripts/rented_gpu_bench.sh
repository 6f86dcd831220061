#!/usr/bin/env bash
# One command on a freshly rented GPU box: install llmopt, run `bench throughput` and `bench latency` on MODEL,
# and leave one folder to copy home (results.json, report.md and plots per benchmark, plus nvidia-smi and
# the install log).
#   bash scripts/rented_gpu_bench.sh MODEL [OUT_DIR]        # MODEL: default, a hub id, a folder or a .gguf
# Environment: ENGINES (default "hf-batch,llmopt,vllm": vLLM is used where installed, skipped otherwise),
# BATCH_SIZES (default "1,8,32"), NUM_PROMPTS (default 256), DTYPE (default auto: bfloat16 on a GPU),
# EXTRA_BENCH_ARGS. An installed CUDA build of torch is kept (scripts/setup.sh); where nvidia-smi sees a GPU
# but torch cannot use it, the script stops with one line rather than benchmark the CPU.
set -euo pipefail
MODEL=${1:?usage: bash scripts/rented_gpu_bench.sh MODEL [OUT_DIR]}
OUT=$(realpath -m "${2:-bench-results-$(date +%Y%m%d-%H%M%S)}")
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || echo "no nvidia-smi: running on CPU" | tee "$OUT/nvidia-smi.txt"
EXTRAS=bench bash scripts/setup.sh > "$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
. .venv/bin/activate
. scripts/torch_env.sh
if gpu_without_cuda_torch python; then exit 1; fi
DTYPE=${DTYPE:-auto}
set -x
# --device auto (the default): the GPU
llmopt bench throughput "$MODEL" --engines "${ENGINES:-hf-batch,llmopt,vllm}" --num-prompts "${NUM_PROMPTS:-256}" \
  --dtype "$DTYPE" -o "$OUT/throughput" ${EXTRA_BENCH_ARGS:-} | tee "$OUT/throughput.txt"
llmopt bench latency "$MODEL" --batch-size "${BATCH_SIZES:-1,8,32}" --dtype "$DTYPE" \
  -o "$OUT/latency" ${EXTRA_BENCH_ARGS:-} | tee "$OUT/latency.txt"
set +x
echo "results in $OUT (copy it home: scp -r host:$OUT .)"
