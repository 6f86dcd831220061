#!/usr/bin/env bash
# Build llama.cpp's llama-bench and llama-server for this CPU, from the llama.cpp that
# llama-cpp-python vendors (the version setup.sh pins), into
# $LLMOPT_CACHE/llama.cpp/<version>-<cpu digest>/ (llmopt/bench/llama_cpp_bin.py reads it back).
# Idempotent: a folder that already has its `bin` is left alone. Minutes on 2 cores; not shipped.
#
#   bash scripts/build_llama_cpp.sh             # build, check, pick
#   LLAMA_CPP_SDIST=x.tar.gz bash ...           # an sdist already downloaded (offline)
#   JOBS=8 NICE=0 bash ...                      # on a machine of your own
#
# Variants, each in <folder>/<variant>/bin:
#   native        -DGGML_NATIVE=ON: what `pip install llama-cpp-python` and a source build of
#                 llama.cpp give on this CPU (AVX-512, VNNI, AMX where the CPU has them).
#   native-noamx  the same with -mno-amx-*: built only where `native` fails its check. With
#                 GGML_NATIVE=ON the GGML_AMX_TILE/INT8/BF16 options are not read (-march=native
#                 turns AMX on by itself), so AMX is taken off at the compiler.
# The check: llama-bench pp512 on the default model's GGUF. On some Intel CPUs with AMX the native
# build segfaults in prompt evaluation (ggml-org/llama.cpp#20824). <folder>/bin links the first
# variant that passes and <folder>/chosen.txt says which and why.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
VERSION=${LLAMA_CPP_VERSION:-$(sed -n 's/.*LLAMA_CPP_VERSION:-\([0-9][0-9.]*\)}.*/\1/p' scripts/setup.sh | head -n1)}
JOBS=${JOBS:-2}
NICE=${NICE:-19}
THREADS=${THREADS:-$(nproc)}
dest=$("$PY" -c 'import sys; from llmopt.bench.llama_cpp_bin import build_folder; print(build_folder(sys.argv[1]))' "$VERSION")
model=${MODEL:-$("$PY" -c 'from llmopt.core.embedded import default_gguf_path; print(default_gguf_path())')}

if [ -x "$dest/bin/llama-bench" ] && [ -x "$dest/bin/llama-server" ]; then
  echo "llama.cpp $VERSION: $(cat "$dest/chosen.txt" 2>/dev/null) in $dest/bin (already built)"
  exit 0
fi
mkdir -p "$dest"

source_dir() {  # the vendored llama.cpp, unpacked once into $dest/src
  local src="$dest/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
  if [ ! -f "$src/CMakeLists.txt" ]; then
    local sdist=${LLAMA_CPP_SDIST:-}
    if [ -z "$sdist" ]; then
      rm -rf "$dest/download" && mkdir -p "$dest/download"
      "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
        -d "$dest/download" "llama-cpp-python==$VERSION" >&2
      sdist=$(ls "$dest"/download/llama_cpp_python-*.tar.gz)
    fi
    rm -rf "$dest/src" && mkdir -p "$dest/src"
    tar -xzf "$sdist" -C "$dest/src"
    rm -rf "$dest/download"
  fi
  echo "$src"
}

build_variant() {  # build_variant NAME [extra cmake args...]: llama-bench and llama-server into $dest/NAME/bin
  local name=$1; shift
  local out="$dest/$name"
  if [ -x "$out/bin/llama-bench" ] && [ -x "$out/bin/llama-server" ]; then
    return 0
  fi
  local src build
  src=$(source_dir)
  build="$out/build"
  echo "building llama.cpp $VERSION ($name) in $build: minutes on $JOBS jobs" >&2
  # static libraries: the two binaries stand alone in bin/. No OpenSSL (local HTTP only), no web UI
  # assets from the network, no tests or examples.
  nice -n "$NICE" cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF "$@" >"$out.cmake.log" 2>&1 \
    || { tail -n 20 "$out.cmake.log" >&2; return 1; }
  nice -n "$NICE" cmake --build "$build" --target llama-bench llama-server -j "$JOBS" >"$out.build.log" 2>&1 \
    || { tail -n 20 "$out.build.log" >&2; return 1; }
  mkdir -p "$out/bin.tmp"
  cp "$build/bin/llama-bench" "$build/bin/llama-server" "$out/bin.tmp/"
  grep -E "^(GGML_NATIVE|CMAKE_C_FLAGS|CMAKE_CXX_FLAGS|CMAKE_CXX_COMPILER):" "$build/CMakeCache.txt" \
    >"$out/bin.tmp/cmake-options.txt" || true
  rm -rf "$out/bin" && mv "$out/bin.tmp" "$out/bin"
  [ -n "${KEEP_BUILD:-}" ] || rm -rf "$build"
}

check_variant() {  # check_variant NAME: 0 when llama-bench pp512 runs; the reason on stdout otherwise
  local rc=0
  timeout 600 nice -n "$NICE" "$dest/$1/bin/llama-bench" -m "$model" -p 512 -n 0 -r 1 -t "$THREADS" -o json \
    >"$dest/$1.check.json" 2>"$dest/$1.check.log" || rc=$?
  if [ "$rc" -ne 0 ]; then
    local why="exit $rc"
    [ "$rc" -ge 128 ] && [ "$rc" -lt 160 ] && why="killed by signal $((rc - 128))$([ "$rc" -eq 139 ] && echo ' (SIGSEGV)')"
    echo "$why"
    return 1
  fi
}

pick() {  # pick NAME REASON
  ln -sfn "$1/bin" "$dest/bin"
  echo "$1 ($2)" >"$dest/chosen.txt"
  echo "llama.cpp $VERSION: $1 ($2) in $dest/bin"
}

build_variant native
if why=$(check_variant native); then
  pick native "its llama-bench pp512 runs"
  exit 0
fi
echo "native: llama-bench pp512 on $(basename "$model") failed: $why (see $dest/native.check.log)" >&2
if ! grep -qw amx_tile /proc/cpuinfo; then
  echo "no variant runs here: the native build fails its check on a CPU without AMX" >&2
  exit 1
fi
build_variant native-noamx -DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \
  -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if why2=$(check_variant native-noamx); then
  pick native-noamx "native's AMX path: llama-bench pp512 $why, as in ggml-org/llama.cpp#20824"
  exit 0
fi
echo "native-noamx: llama-bench pp512 failed too: $why2 (see $dest/native-noamx.check.log)" >&2
exit 1
