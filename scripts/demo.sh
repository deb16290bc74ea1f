#!/usr/bin/env bash
# The main job on the shipped defaults: provisions libtorch, builds treetrain in release mode and
# runs `treetrain demo` (outputs in demo-out/ unless --out is given).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$TREETRAIN_ROOT"
bash scripts/setup-libtorch.sh
cargo run --release --quiet -- demo "$@"
