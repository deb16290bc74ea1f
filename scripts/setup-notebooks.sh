#!/usr/bin/env bash
# Everything headless notebook execution needs, idempotent:
#   - evcxr_jupyter (the Rust kernel), built once into the user cache ($TREETRAIN_CACHE)
#   - a venv with nbclient (`jupyter execute`) in .deps/venv
#   - a kernel spec in .deps/jupyter/kernels/treetrain-rust whose env carries LIBTORCH and
#     LD_LIBRARY_PATH (cells dlopen code linked against libtorch; `:env` cannot fix that later)
#     and a persistent EVCXR_TMPDIR, where the kernel builds its dependencies
#   - that build done once here (tests/notebooks/warmup.ipynb: the `:dep treetrain` every
#     notebook starts with), so the first notebook a user opens starts in seconds, not minutes
# `scripts/setup-notebooks.sh --user` also installs that kernel spec for your own Jupyter.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
bash "$TREETRAIN_ROOT/scripts/setup-libtorch.sh"

evcxr_root=$TREETRAIN_CACHE/evcxr-$EVCXR_VERSION
evcxr=$evcxr_root/bin/evcxr_jupyter
if [ ! -x "$evcxr" ]; then
    command -v cargo >/dev/null 2>&1 || die "cargo not found: install Rust with rustup first"
    note "building evcxr_jupyter $EVCXR_VERSION into $evcxr_root (about 8 minutes, once per machine; cargo's progress follows)"
    started=$(date +%s)
    # --locked: without it evcxr's rust-analyzer dependencies resolve to versions that fail to build.
    # cargo prints one line per crate compiled: the progress a user waits on.
    cargo install --locked evcxr_jupyter --version "$EVCXR_VERSION" --root "$evcxr_root" 2>&1 \
        | grep --line-buffered -E "Compiling|Installing|Installed|error|warning: build failed" >&2 \
        || true
    [ -x "$evcxr" ] || die "cargo install evcxr_jupyter failed (see above); crates.io must be reachable"
    note "evcxr_jupyter built in $(( $(date +%s) - started )) s"
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

# Warm the kernel's dependency build: the first `:dep treetrain` compiles tch, arrow, tokenizers,
# ... inside evcxr (about 10 minutes on 2 cores). Done once per Cargo.lock; a later change to
# treetrain itself recompiles only treetrain in the notebook.
lock_hash=$(sha256sum "$TREETRAIN_ROOT/Cargo.lock" | cut -c1-16)
stamp=$TREETRAIN_DEPS/evcxr-tmp/.warm-$lock_hash
if [ ! -e "$stamp" ] && [ "${TREETRAIN_SKIP_WARMUP:-}" != 1 ]; then
    note "warming the notebook kernel's build cache (treetrain and its dependencies compiled once, as the first notebook cell would; about 10 minutes)"
    started=$(date +%s)
    ( while sleep 60; do note "  still compiling the kernel's dependencies: $(( $(date +%s) - started )) s"; done ) &
    ticker=$!
    if ! JUPYTER_PATH=$TREETRAIN_DEPS/jupyter "$venv/bin/python" "$TREETRAIN_ROOT/scripts/execute_notebook.py" \
        "$TREETRAIN_ROOT/tests/notebooks/warmup.ipynb" "$TREETRAIN_DEPS/evcxr-tmp/warmup.out.ipynb" >&2; then
        kill "$ticker" 2>/dev/null || true
        die "the warm-up notebook failed (see above)"
    fi
    kill "$ticker" 2>/dev/null || true
    touch "$stamp"
    note "kernel build cache warm in $(( $(date +%s) - started )) s: notebooks now start in seconds"
fi
