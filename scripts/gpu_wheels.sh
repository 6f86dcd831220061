#!/usr/bin/env bash
# Download, here (with network), the wheels scripts/gpu_check.sh installs on a lent GPU machine,
# which has no network: the packages of scripts/gpu_wheels.txt, for CPython 3.12 on x86-64 Linux,
# into .whl/. It is git-ignored, so the device tool takes it only when named: carry=[".whl"].
# Never torch or triton: the machine has its own, built for its driver.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -v '^#' scripts/gpu_wheels.txt | awk 'NF {print $1}' | while read -r requirement; do
  # --platform lists manylinux tags; pure-Python wheels (py3-none-any) match any of them
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$requirement"
done
total=$(du -cb .whl/*.whl | tail -1 | cut -f1)
echo "$(ls .whl/*.whl | wc -l) wheels, $((total / 1048576)) MiB in .whl/"
if [ "$total" -gt $((40 * 1048576)) ]; then
  echo "error: .whl/ is over 40 MiB (the device tool carries 64 MiB in all)" >&2
  exit 1
fi
