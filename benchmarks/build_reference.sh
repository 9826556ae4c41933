#!/usr/bin/env bash
# Builds llama.cpp's own llama-server and llama-batched-bench from the pinned, vendored tree
# (vendor/llama.cpp, with our patches), outside the package build, into build/reference/.
# Same compiler flags as the extension's llama.cpp: Release, -march=native, AMX off.
set -euo pipefail
cd "$(dirname "$0")/.."
src=vendor/llama.cpp
if [ ! -f "$src/CMakeLists.txt" ]; then
  # the tree is fetched at the extension's configure time; fetch it the same way
  python vendor/fetch_llama_cpp.py "$src"
fi
no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
launcher=()
if command -v ccache >/dev/null 2>&1; then
  launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
gen=()
if command -v ninja >/dev/null 2>&1; then gen=(-G Ninja); fi
cmake -S "$src" -B build/reference "${gen[@]}" "${launcher[@]}" \
  -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx" \
  -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
cmake --build build/reference --target llama-server llama-batched-bench -j "$(nproc)"
ls -l build/reference/bin/llama-server build/reference/bin/llama-batched-bench
