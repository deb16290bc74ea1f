#!/usr/bin/env bash
# The whole test suite on a fresh machine: provisions libtorch, runs every Rust test (slow ones
# included) and the GPU check's CPU rehearsal, then executes every notebook with the evcxr
# kernel and looks at the rendered pages.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$TREETRAIN_ROOT"
bash scripts/setup-libtorch.sh
# Real torchrun for the multi-process tests (tests/distributed.rs).
TREETRAIN_TORCHRUN=$(bash scripts/setup-torchrun.sh)
export TREETRAIN_TORCHRUN
# PEFT beside that torch, for the adapter cross-checks (tests/lora.rs).
TREETRAIN_PEFT_PYTHON=$(bash scripts/setup-peft.sh)
export TREETRAIN_PEFT_PYTHON
# TensorBoard's and pandas' readers for the run-log checks (tests/run_logs.rs).
TREETRAIN_LOG_READERS_PYTHON=$(bash scripts/setup-run-log-readers.sh)
export TREETRAIN_LOG_READERS_PYTHON
echo "== cargo test (unit, integration, doc; slow tests included)"
cargo test --all-targets -- --include-ignored
cargo test --doc
echo "== the GPU check rehearsed on the CPU (release binaries packed as they travel; a few minutes)"
bash scripts/gpu-check.sh prepare
PYTHON=$TREETRAIN_PEFT_PYTHON bash scripts/gpu-check.sh rehearse target/gpu-rehearsal
echo "== notebooks"
bash scripts/run-notebooks.sh
echo "== rendered notebooks (headless Chromium at 1300 px)"
bash scripts/render-notebooks.sh --check
