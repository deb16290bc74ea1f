#!/usr/bin/env bash
# Everything headless notebook execution needs, idempotent:
#   - evcxr_jupyter (the Rust kernel), built once into the user cache ($TREETRAIN_CACHE)
#   - a venv with nbclient (`jupyter execute`) in .deps/venv
#   - a kernel spec in .deps/jupyter/kernels/treetrain-rust whose env carries LIBTORCH and
#     LD_LIBRARY_PATH (cells dlopen code linked against libtorch; `:env` cannot fix that later)
#     and a persistent EVCXR_TMPDIR so the second run of a notebook is warm.
# `scripts/setup-notebooks.sh --user` also installs that kernel spec for your own Jupyter.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
bash "$TREETRAIN_ROOT/scripts/setup-libtorch.sh"

evcxr_root=$TREETRAIN_CACHE/evcxr-$EVCXR_VERSION
evcxr=$evcxr_root/bin/evcxr_jupyter
if [ ! -x "$evcxr" ]; then
    command -v cargo >/dev/null 2>&1 || die "cargo not found: install Rust with rustup first"
    note "building evcxr_jupyter $EVCXR_VERSION into $evcxr_root (about 8 minutes, once per machine)"
    # --locked: without it evcxr's rust-analyzer dependencies resolve to versions that fail to build.
    cargo install --quiet --locked evcxr_jupyter --version "$EVCXR_VERSION" --root "$evcxr_root" \
        || die "cargo install evcxr_jupyter failed (see above); crates.io must be reachable"
fi

venv=$TREETRAIN_DEPS/venv
if [ ! -x "$venv/bin/jupyter-execute" ]; then
    command -v "$PYTHON" >/dev/null 2>&1 || die "'$PYTHON' not found: install python3 (Debian: apt-get install python3 python3-venv)"
    "$PYTHON" -m venv "$venv" || die "could not create a venv (Debian: apt-get install python3-venv)"
    "$venv/bin/python" -m pip install --quiet "nbclient==$NBCLIENT_VERSION" "nbformat" \
        || die "pip could not install nbclient from PyPI"
fi

write_kernel_spec() {
    local dir=$1
    mkdir -p "$dir"
    "$PYTHON" - "$dir/kernel.json" "$evcxr" "$LIBTORCH_DIR" "$TREETRAIN_DEPS/evcxr-tmp" <<'PY'
import json, sys
path, evcxr, libtorch, tmp = sys.argv[1:5]
json.dump({
    "argv": [evcxr, "--control_file", "{connection_file}"],
    "display_name": "Rust (treetrain)",
    "language": "rust",
    "interrupt_mode": "message",
    "env": {"LIBTORCH": libtorch, "LD_LIBRARY_PATH": libtorch + "/lib", "EVCXR_TMPDIR": tmp},
}, open(path, "w"), indent=1)
PY
}
mkdir -p "$TREETRAIN_DEPS/evcxr-tmp"
write_kernel_spec "$TREETRAIN_DEPS/jupyter/kernels/treetrain-rust"
if [ "${1:-}" = "--user" ]; then
    user_dir=${JUPYTER_DATA_DIR:-$HOME/.local/share/jupyter}/kernels/treetrain-rust
    write_kernel_spec "$user_dir"
    note "kernel 'Rust (treetrain)' installed in $user_dir"
fi
