#!/usr/bin/env bash
# Install llmopt with its test dependencies and run the test suite (offline).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=dev bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1
exec pytest -q "$@"
