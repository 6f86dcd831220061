# Which torch a Python has, and what the set-up scripts do about it (sourced by setup.sh and
# rented_gpu_bench.sh; tests/test_setup_scripts.py runs these functions against a stub python).
#
# A CUDA (or ROCm) build of torch that is already installed is kept, never replaced: it is the
# one that matches the machine's driver, and a pinned `torch==` from the index would be a
# multi-GB download of a build of unknown CUDA version. Only where there is no torch, or a CPU
# build, is the pinned version installed.

TORCH_PIN=${TORCH_VERSION:-2.13.0}

# torch_build PY: "gpu" (a CUDA/ROCm build), "cpu" (a CPU-only build) or "none" (no torch) for interpreter PY
torch_build() {
  "$1" -c 'import torch; print("gpu" if (torch.version.cuda or getattr(torch.version, "hip", None)) else "cpu")' \
    2>/dev/null || echo none
}

# venv_flags PY: the flags for `PY -m venv`: a new venv sees PY's packages where PY has a GPU build of
# torch, so that build is the venv's torch (nothing installed over it)
venv_flags() {
  if [ "$(torch_build "$1")" = gpu ]; then echo --system-site-packages; fi
}

# ensure_torch: in the active environment (`python`), keep a GPU build of torch; install the pinned
# version where there is none or a CPU build (a no-op where the pinned CPU build is already there)
ensure_torch() {
  case "$(torch_build python)" in
    gpu) echo "torch: keeping the installed GPU build ($(python -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda or torch.version.hip)' 2>/dev/null))" ;;
    *) python -m pip install --quiet --disable-pip-version-check "torch==$TORCH_PIN" ;;
  esac
}

# gpu_without_cuda_torch PY: succeeds (and says so in one line on stderr) where nvidia-smi sees a GPU but
# PY's torch cannot use CUDA, so a benchmark would quietly run on the CPU
gpu_without_cuda_torch() {
  local gpu
  gpu=$(nvidia-smi -L 2>/dev/null | head -n1) || return 1
  [ -n "$gpu" ] || return 1
  "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null && return 1
  echo "error: nvidia-smi sees a GPU (${gpu%% (UUID*}) but torch $("$1" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo '(none)') in this environment cannot use CUDA (a CPU build, or one built for a newer driver): install a CUDA build of torch that matches the driver, then rerun" >&2
  return 0
}
