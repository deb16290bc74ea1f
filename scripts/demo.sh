#!/usr/bin/env bash
# The main job on the shipped defaults: provisions libtorch, builds treetrain in release mode and
# runs `treetrain demo` (outputs in demo-out/ unless --out is given).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$TREETRAIN_ROOT"
bash scripts/setup-libtorch.sh
# The first build compiles treetrain and its dependencies (about 8 minutes on 2 cores): say so and
# show cargo's progress. Later runs rebuild only what changed, quietly.
if [ ! -x target/release/treetrain ]; then
    note "first run: building treetrain in release mode (about 8 minutes on 2 cores; later runs start at once)"
    cargo build --release
else
    cargo build --release --quiet
fi
echo "treetrain: running the demo (about 3 minutes; outputs in demo-out/ unless --out is given)" >&2
exec target/release/treetrain demo "$@"
