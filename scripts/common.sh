# Shared paths for treetrain's scripts; sourced, never run.
# Everything the project installs lives in two places:
#   $TREETRAIN_ROOT/.deps        per-checkout (libtorch layout, kernel spec, notebook venv)
#   $TREETRAIN_CACHE             per-user download cache, reused by every checkout
TREETRAIN_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TREETRAIN_CACHE=${TREETRAIN_CACHE:-$HOME/.cache/treetrain}
TREETRAIN_DEPS=$TREETRAIN_ROOT/.deps
TORCH_VERSION=2.11.0
CUDA_RUNTIME_VERSION=13.0.96
CUDA_CUPTI_VERSION=13.0.85
CUDA_CRT_VERSION=13.0.88
EVCXR_VERSION=0.22.0
NBCLIENT_VERSION=0.10.2
LIBTORCH_DIR=${TREETRAIN_LIBTORCH:-$TREETRAIN_DEPS/libtorch}
PYTHON=${PYTHON:-python3}

die() {
    echo "treetrain setup: error: $*" >&2
    exit 1
}
note() { echo "treetrain setup: $*" >&2; }
NBCONVERT_VERSION=7.17.2
PLAYWRIGHT_VERSION=1.65.2
