#!/usr/bin/env bash
# The full `llmopt eval` report of issue 5 on the embedded default model (fp32 baseline):
# RTN and AWQ at 4 bits, group size 64, on ppl + KLD (4,096 tokens), MMLU (the whole bundled
# 1,140-question subset) and HumanEval (all 164 problems, greedy pass@1), against the
# default gates; then a deliberately broken candidate (RTN with one group per row,
# group size -1) that must fail the gates with exit code 1, and the baseline against
# itself, which must pass. Run on an idle machine: ~1 h 15 min on 2 CPU cores.
#
#   bash scripts/eval_full_report.sh [OUT_DIR] [CALIB]
#
# Each eval's JSON report, per-sample log and `/usr/bin/time -v` output land in OUT_DIR
# (default /tmp/eval-report); a summary of exit codes and wall times is printed at the end.
set -uo pipefail

out=${1:-/tmp/eval-report}
calib=${2:-self}
mkdir -p "$out"
# a fresh baseline cache, so the first eval's timings include computing the baseline
export LLMOPT_CACHE=${LLMOPT_CACHE_REPORT:-$out/cache}
summary="$out/summary.txt"
: > "$summary"

quantize() {  # name, extra args...
    local name=$1; shift
    [ -e "$out/$name" ] || llmopt quantize default -o "$out/$name" --calib "$calib" "$@" >/dev/null
}

evaluate() {  # name, expected exit code, args...
    local name=$1 expected=$2; shift 2
    /usr/bin/time -v -o "$out/$name.time" llmopt eval "$@" --output "$out/$name.json" --log-samples \
        2> "$out/$name.log"
    local code=$?
    local wall rss
    wall=$(grep 'Elapsed (wall clock)' "$out/$name.time" | awk '{print $NF}')
    rss=$(grep 'Maximum resident' "$out/$name.time" | awk '{print $NF}')
    echo "$name: exit $code (expected $expected), wall $wall, peak RSS $((rss / 1024)) MiB" | tee -a "$summary"
}

quantize rtn --method rtn --group-size 64
quantize awq --method awq --group-size 64
quantize rtn-g-1 --method rtn --group-size -1

full=(--baseline default --tasks ppl,kld,mmlu,humaneval --limit all)
evaluate rtn 1 "$out/rtn" "${full[@]}"         # computes and caches the baseline
evaluate awq 0 "$out/awq" "${full[@]}"         # baseline from the cache
evaluate broken 1 "$out/rtn-g-1" --baseline default
evaluate self 0 default --baseline default
cat "$summary"
