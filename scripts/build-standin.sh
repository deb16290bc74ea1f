#!/usr/bin/env bash
# Builds the stand-in PrivateUse1 backend (tests/standin/standin_backend.cpp), a CPU-memory
# device registered as `neuron`, into target/standin/: libtreetrain_standin.so (with a CPU
# fallback for every op), libtreetrain_standin_nofallback.so (without: ops it lacks fail) and
# libtreetrain_standin_noview.so (with the fallback but no `view` kernel).
# Tests build it themselves through tests/common; this script is for notebooks and by hand.
# Usage: scripts/build-standin.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh
out="${1:-target/standin}"
mkdir -p "$out"
LIBTORCH="${LIBTORCH:-$LIBTORCH_DIR}"
inc="$LIBTORCH/include"
build() {
  local dest="$1"; shift
  if [ "$dest" -nt tests/standin/standin_backend.cpp ]; then return; fi
  local tmp="$dest.tmp-$$"
  c++ -std=c++17 -O1 -shared -fPIC -D_GLIBCXX_USE_CXX11_ABI=1 "$@" \
    -I"$inc" -I"$inc/torch/csrc/api/include" tests/standin/standin_backend.cpp \
    -L"$LIBTORCH/lib" -Wl,-rpath,"$LIBTORCH/lib" -ltorch_cpu -lc10 -o "$tmp"
  mv -f "$tmp" "$dest"
}
build "$out/libtreetrain_standin.so"
build "$out/libtreetrain_standin_nofallback.so" -DSTANDIN_NO_FALLBACK
build "$out/libtreetrain_standin_noview.so" -DSTANDIN_NO_VIEW
echo "stand-in backend: $out/libtreetrain_standin.so"
