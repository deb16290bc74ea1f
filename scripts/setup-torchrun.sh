#!/usr/bin/env bash
# A Python with the torch 2.11.0 wheel, for the tests that launch treetrain under real
# `torchrun` (the launcher every PyTorch GPU user runs). Prints torchrun's path.
#
# About 3 GB with torch's CUDA dependencies (pip resolves them from PyPI; the torch wheel
# itself comes from the cache setup-libtorch.sh filled). Lives in the user cache, reused.
# Idempotent: returns at once when the venv works.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
venv=$TREETRAIN_CACHE/torchrun-venv
if ! "$venv/bin/python" -c "import torch, torch.distributed.run" >/dev/null 2>&1; then
    note "installing torch==$TORCH_VERSION into $venv for the torchrun tests (about a minute)"
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    "$venv/bin/pip" install -q --find-links "$TREETRAIN_CACHE/wheels" "torch==$TORCH_VERSION" numpy ||
        die "pip could not install torch==$TORCH_VERSION into $venv (PyPI unreachable?)"
    "$venv/bin/python" -c "import torch.distributed.run" ||
        die "torch in $venv cannot import torch.distributed.run"
fi
echo "$venv/bin/torchrun"
