#!/usr/bin/env bash
# TensorBoard 2.21.0 and pandas 3.1.1 beside the torch of the torchrun venv
# (scripts/setup-torchrun.sh), for the test that reads treetrain's run logs with their own
# readers (tests/run_logs.rs: EventAccumulator, pandas.read_csv). Prints that venv's python.
# Idempotent; seconds once torch is there.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
torchrun=$(bash "$TREETRAIN_ROOT/scripts/setup-torchrun.sh")
python=$(dirname "$torchrun")/python
if ! "$python" -c "import tensorboard, pandas" >/dev/null 2>&1; then
    note "installing tensorboard==2.21.0 and pandas==3.1.1 beside torch (for the run-log checks)"
    "$python" -m pip install -q "tensorboard==2.21.0" "pandas==3.1.1" ||
        die "pip could not install tensorboard and pandas (PyPI unreachable?)"
fi
echo "$python"
