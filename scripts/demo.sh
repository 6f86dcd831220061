#!/usr/bin/env bash
# Install llmopt and run its main job on the embedded default model (SmolLM2-135M-Instruct).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
llmopt models info default
llmopt generate default --prompt "What is the capital of France?" --max-tokens 32 --temperature 0
