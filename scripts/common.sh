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
CUDA_CCCL_VERSION=13.0.85
# The NCCL torch 2.11.0 pins (its wheel's Requires-Dist): ProcessGroupNCCL::Options embeds ncclConfig_t.
NCCL_VERSION=2.28.9
EVCXR_VERSION=0.22.0
NBCLIENT_VERSION=0.10.2
LIBTORCH_DIR=${TREETRAIN_LIBTORCH:-$TREETRAIN_DEPS/libtorch}
PYTHON=${PYTHON:-python3}

die() {
    echo "treetrain setup: error: $*" >&2
    exit 1
}
note() { echo "treetrain setup: $*" >&2; }

# beside_torch WHAT IMPORTS PKG...: installs the pip packages PKG... into the torchrun venv
# (scripts/setup-torchrun.sh) unless `import IMPORTS` already works there, for the checks that
# run a library's own Python code (WHAT says which); prints that venv's python.
beside_torch() {
    local what=$1 imports=$2
    shift 2
    local torchrun python
    torchrun=$(bash "$TREETRAIN_ROOT/scripts/setup-torchrun.sh")
    python=$(dirname "$torchrun")/python
    if ! "$python" -c "import $imports" >/dev/null 2>&1; then
        note "installing $* beside torch ($what)"
        "$python" -m pip install -q "$@" || die "pip could not install $* (PyPI unreachable?)"
    fi
    echo "$python"
}
NBCONVERT_VERSION=7.17.2
PLAYWRIGHT_VERSION=1.65.2
