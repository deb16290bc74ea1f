#!/usr/bin/env bash
# PEFT 0.21.2 and transformers 5.23.0 beside the torch of the torchrun venv
# (scripts/setup-torchrun.sh), for the tests that check adapters against PEFT itself
# (tests/lora.rs: PEFT loads what treetrain saves). Prints that venv's python.
# Idempotent; a few seconds once torch is there (the two are pure Python).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
beside_torch "for the PEFT cross-checks" "peft, transformers" "peft==0.21.2" "transformers==5.23.0"
