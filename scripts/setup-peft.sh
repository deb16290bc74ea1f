#!/usr/bin/env bash
# PEFT 0.21.2 and transformers 5.23.0 beside the torch of the torchrun venv
# (scripts/setup-torchrun.sh), for the tests that check adapters against PEFT itself
# (tests/lora.rs: PEFT loads what treetrain saves). Prints that venv's python.
# Idempotent; a few seconds once torch is there (the two are pure Python).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
torchrun=$(bash "$TREETRAIN_ROOT/scripts/setup-torchrun.sh")
python=$(dirname "$torchrun")/python
if ! "$python" -c "import peft, transformers" >/dev/null 2>&1; then
    note "installing peft==0.21.2 and transformers==5.23.0 beside torch (for the PEFT cross-checks)"
    "$python" -m pip install -q "peft==0.21.2" "transformers==5.23.0" ||
        die "pip could not install peft and transformers (PyPI unreachable?)"
fi
echo "$python"
