#!/usr/bin/env bash
# TensorBoard 2.21.0 and pandas 3.1.1 beside the torch of the torchrun venv
# (scripts/setup-torchrun.sh), for the test that reads treetrain's run logs with their own
# readers (tests/run_logs.rs: EventAccumulator, pandas.read_csv). Prints that venv's python.
# Idempotent; seconds once torch is there.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
beside_torch "for the run-log checks" "tensorboard, pandas" "tensorboard==2.21.0" "pandas==3.1.1"
